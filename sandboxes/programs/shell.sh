# agentrl repo_fix: one `bash` tool call, run as `bash -c "$(cat shell.sh)" agentrl-bash COMMAND`.
# No process outlives its call (the executor sweeps them all), so the episode's shell state lives in files:
# the working directory and the exported variables are restored before COMMAND and saved after it, also when
# COMMAND calls `exit`. A call killed at its time limit saves nothing: the next one starts where this one began.
__agentrl_state=/work/.agentrl/shell
if [ -r "$__agentrl_state/env" ]; then . "$__agentrl_state/env" >/dev/null 2>&1; fi
cd -- "$(cat "$__agentrl_state/cwd" 2>/dev/null || echo /work/repo)" 2>/dev/null || cd /work/repo 2>/dev/null || cd /work
__agentrl_save() {
  __agentrl_rc=$?
  mkdir -p "$__agentrl_state" 2>/dev/null
  pwd >"$__agentrl_state/cwd.new" 2>/dev/null && mv -f "$__agentrl_state/cwd.new" "$__agentrl_state/cwd" 2>/dev/null
  export -n OLDPWD PWD SHLVL 2>/dev/null
  export -p >"$__agentrl_state/env.new" 2>/dev/null && mv -f "$__agentrl_state/env.new" "$__agentrl_state/env" 2>/dev/null
  exit "$__agentrl_rc"
}
trap __agentrl_save EXIT
__agentrl_command=$1
shift
eval "$__agentrl_command"
