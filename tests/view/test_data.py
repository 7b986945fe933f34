"""The viewer's reading of JSONL files that are being written, torn or rewritten (no server needed)."""

from agentrl.runs import JsonlTail


def test_a_tail_follows_a_file_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.rows() == [] and tail.warnings == []  # not written yet
    path.write_text('{"iteration": 0}\n{"iteration": 1, "x"')
    assert tail.rows() == [{"iteration": 0}]
    assert "last line is incomplete" in tail.warnings[0]
    with open(path, "a") as f:
        f.write(': 2}\nnot json\n{"iteration": 2}\n')
    assert tail.rows() == [{"iteration": 0}, {"iteration": 1, "x": 2}, {"iteration": 2}]
    assert tail.warnings == ["metrics.jsonl line 3: unreadable, skipped (b'not json')"]
    path.write_text('{"iteration": 0}\n')  # a resume rewrote it shorter
    assert tail.rows() == [{"iteration": 0}] and tail.warnings == []
