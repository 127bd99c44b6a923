"""The batch store: records saved atomically and read back in OpenAI's shape; result logs that survive a crash
mid-write (the half-written line cut off) and know which custom ids are done; one process at a time runs a batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lmserve.store.batches import BatchStore, ResultLog


def test_a_new_batch_reads_back_in_openais_shape(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    record = store.new("/v1/chat/completions", "file-x", "24h", 24 * 3600, {"k": "v"})
    again = store.get(record.id)
    assert again == record
    body = again.to_openai()
    assert body["object"] == "batch" and body["status"] == "validating" and body["metadata"] == {"k": "v"}
    assert body["expires_at"] == body["created_at"] + 24 * 3600
    assert body["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert body["errors"] is None and body["output_file_id"] is None
    assert [r.id for r in store.all()] == [record.id]


def test_a_result_log_cuts_a_half_written_last_line_and_knows_what_is_done(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    log = ResultLog(path)
    log.append({"custom_id": "a", "response": {}})
    log.append({"custom_id": "b", "response": {}})
    log.close()
    with open(path, "ab") as out:
        out.write(b'{"custom_id": "c", "resp')
    again = ResultLog(path)
    assert again.done == {"a", "b"} and again.num_lines == 2
    again.append({"custom_id": "c", "response": {}})
    again.close()
    assert [json.loads(line)["custom_id"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_a_result_line_without_its_newline_is_not_done(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}')
    log = ResultLog(path)
    assert log.done == {"a"}
    log.close()
    assert path.read_bytes() == b'{"custom_id": "a"}\n'


def test_only_one_process_at_a_time_holds_a_batch(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    record = store.new("/v1/chat/completions", "file-x", "24h", 3600, None)
    claim = store.claim(record.id)
    assert claim is not None
    probe = ("import sys; from pathlib import Path; from lmserve.store.batches import BatchStore; "
             f"sys.exit(0 if BatchStore(Path({str(tmp_path)!r})).claim({record.id!r}) is None else 1)")
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0  # held here
    claim.release()
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 1  # free again
