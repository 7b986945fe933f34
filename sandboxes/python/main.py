"""Starts the sandbox executor: `python3 main.py ARGS` is executor.py's main(ARGS).

Python never caches a script's bytecode, so executor.py run as the script would be compiled afresh at every
sandbox's start (a fifth of a cold start); imported from here, it loads from its __pycache__, which the image
build (and, for bwrap, the host) compiles once.
"""

import gc

# Off while the executor's modules load (their garbage collections were a twentieth of its start); main() turns
# it back on, before the zygote, the spares or the session run anything.
gc.disable()
import executor  # noqa: E402

executor.main()
