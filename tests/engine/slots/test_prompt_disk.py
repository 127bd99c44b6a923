"""The disk tier of the prompt cache keeps verified prompt states on disk, within its budget, across restarts."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from lmserve.engine.slots import prompt_disk
from lmserve.engine.slots.prompt_disk import DiskTier

MODEL = "smollm2 q4_1 ctx=8192 kv=f16"
OTHER = "qwen3 q8_0 ctx=4096 kv=q8_0"
A: tuple[int, ...] = (1, 2, 3)
B: tuple[int, ...] = (1, 2, 3, 4)
C: tuple[int, ...] = (7, 8)
D: tuple[int, ...] = (9, 9, 9)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    disk = DiskTier(tmp_path / "cache", 1 << 20)
    yield disk
    disk.close()


def entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.state"))


def entry_path(root: Path, model_key: str, tokens: tuple[int, ...]) -> Path:
    name = prompt_disk._file_name(model_key, prompt_disk._token_bytes(tokens))
    return root / prompt_disk._folder_name(model_key) / name


def saved(root: Path, model_key: str, tokens: tuple[int, ...], state: bytes) -> Path:
    """Write one entry with a tier of its own and return its file."""
    disk = DiskTier(root, 1 << 20)
    disk.put(model_key, tokens, state)
    disk.close()
    return entry_path(root, model_key, tokens)


def entry_size(tmp_path: Path, tokens: tuple[int, ...], state: bytes) -> int:
    return saved(tmp_path / "probe", MODEL, tokens, state).stat().st_size


def test_a_state_put_is_loaded_back_exactly_and_listed_under_its_model(tier: DiskTier) -> None:
    tier.put(MODEL, A, b"state-a")
    tier.put(MODEL, B, b"state-b")
    tier.put(OTHER, A, b"other-a")
    tier.flush()
    assert tier.load(MODEL, A) == b"state-a" and tier.load(OTHER, A) == b"other-a"
    assert sorted(tier.keys(MODEL)) == [A, B] and tier.keys(OTHER) == [A]
    assert tier.load(MODEL, C) is None and tier.load(MODEL, (1, 2)) is None  # exact tokens only
    assert tier.num_entries == 3 and tier.num_bytes == sum(p.stat().st_size for p in entry_files(tier.root))


def test_a_new_instance_on_the_same_root_sees_the_earlier_entries(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 1 << 20)
    first.put(MODEL, A, b"state-a")
    first.put(OTHER, B, b"state-b")
    first.close()
    second = DiskTier(tmp_path, 1 << 20)
    assert (second.num_entries, second.num_bytes) == (first.num_entries, first.num_bytes) == (2, second.num_bytes)
    assert second.keys(MODEL) == [A] and second.load(MODEL, A) == b"state-a"
    assert second.load(OTHER, B) == b"state-b"  # found by its name before its model key was indexed
    second.close()


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def flip_token_byte(data: bytes) -> bytes:
    at = data.index(b"}\n") + 2
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


BROKEN: list[tuple[str, Callable[[bytes], bytes]]] = [
    ("a corrupt byte in the state", flip_last_byte),
    ("a corrupt byte in the tokens", flip_token_byte),
    ("truncated", lambda data: data[:-3]),
    ("cut inside the header", lambda data: data[:30]),
    ("empty", lambda data: b""),
    ("a byte too many", lambda data: data + b"\0"),
    ("wrong magic", lambda data: data.replace(b"lmserve-prompt-state", b"lmserve-prompt-statf", 1)),
    ("another format version", lambda data: data.replace(b"lmserve-prompt-state 1\n", b"lmserve-prompt-state 2\n")),
    ("a header that is not JSON", lambda data: data.replace(b'{"digest"', b'{"digest', 1)),
    ("a header that lies about the length", lambda data: data.replace(b'"num_tokens": 3', b'"num_tokens": 2', 1)),
    ("a header of another model key", lambda data: data.replace(MODEL.encode(), OTHER.encode(), 1)),
]


@pytest.mark.parametrize("how", [fn for _, fn in BROKEN], ids=[name for name, _ in BROKEN])
@pytest.mark.parametrize("first_ask", ["load", "keys"])
def test_a_broken_file_is_never_returned_and_is_removed_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: Callable[[bytes], bytes], first_ask: str
) -> None:
    path = saved(tmp_path, MODEL, A, b"the state bytes")
    path.write_bytes(how(path.read_bytes()))
    disk = DiskTier(tmp_path, 1 << 20)
    with caplog.at_level(logging.WARNING, logger=prompt_disk.__name__):
        if first_ask == "keys":
            disk.keys(MODEL)  # a header that checks out is listed; its state is only verified by load
        assert disk.load(MODEL, A) is None
    assert not path.exists() and disk.num_entries == disk.num_bytes == 0 and disk.keys(MODEL) == []
    assert len(caplog.records) == 1
    disk.close()


def test_a_file_copied_into_another_model_keys_folder_is_foreign(tmp_path: Path) -> None:
    original = saved(tmp_path, MODEL, A, b"state of the first model")
    foreign = entry_path(tmp_path, OTHER, A)
    foreign.parent.mkdir()
    shutil.copy(original, foreign)
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.load(OTHER, A) is None and not foreign.exists()
    assert disk.load(MODEL, A) == b"state of the first model"
    disk.close()


def test_a_file_renamed_within_its_folder_holds_other_tokens_than_its_name(tmp_path: Path) -> None:
    original = saved(tmp_path, MODEL, A, b"state of A")
    other_name = entry_path(tmp_path, MODEL, B)
    original.rename(other_name)
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.load(MODEL, B) is None and not other_name.exists()
    disk.close()


def test_the_least_recently_used_entry_goes_first_across_model_keys_and_a_hit_refreshes(tmp_path: Path) -> None:
    state = b"x" * 1000
    disk = DiskTier(tmp_path / "cache", int(3.5 * entry_size(tmp_path, A, state)))
    for model_key, tokens in [(MODEL, A), (OTHER, A), (MODEL, (7, 8, 9))]:
        disk.put(model_key, tokens, state)
        disk.flush()
    assert disk.load(MODEL, A) == state  # (MODEL, A) is now the most recently used; (OTHER, A) the least
    disk.put(OTHER, D, state)
    disk.flush()
    assert disk.keys(OTHER) == [D] and sorted(disk.keys(MODEL)) == [A, (7, 8, 9)]
    assert disk.num_entries == 3 and disk.num_bytes <= disk.budget_bytes
    disk.close()


def test_a_restart_with_a_smaller_budget_evicts_by_file_age(tmp_path: Path) -> None:
    state = b"x" * 1000
    size = entry_size(tmp_path, A, state)
    first = DiskTier(tmp_path / "cache", 10 * size)
    for tokens in (A, C, D):
        first.put(MODEL, tokens, state)
        first.flush()
    first.close()
    for age, tokens in [(300, A), (100, C), (200, D)]:  # C was used last, then D, then A
        path = entry_path(first.root, MODEL, tokens)
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age))
    second = DiskTier(tmp_path / "cache", int(2.5 * size))
    assert sorted(second.keys(MODEL)) == [C, D] and len(entry_files(second.root)) == 2
    second.close()


@pytest.mark.parametrize(
    ("what", "state", "tokens"),
    [("a state larger than the budget", b"x" * 2000, A), ("no tokens", b"x", ())],
)
def test_what_cannot_be_saved_is_skipped_without_counting_a_drop(
    tmp_path: Path, what: str, state: bytes, tokens: tuple[int, ...]
) -> None:
    disk = DiskTier(tmp_path, 1000)
    disk.put(MODEL, tokens, state)
    disk.flush()
    assert disk.num_entries == disk.num_dropped == 0 and disk.keys(MODEL) == []
    disk.close()


def test_a_zero_budget_turns_the_tier_off(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "cache", 0)
    disk.put(MODEL, A, b"state")
    assert disk.keys(MODEL) == [] and disk.load(MODEL, A) is None and disk.num_bytes == 0
    assert not (tmp_path / "cache").exists()
    disk.close()


@pytest.fixture
def stalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DiskTier, threading.Event]]:
    """A tier whose disk hangs until the event is set."""
    disk = DiskTier(tmp_path / "cache", 40_000)
    release = threading.Event()
    write_file = disk._write_file

    def slow_write(path: Path, chunks: Sequence[bytes]) -> None:
        release.wait()
        write_file(path, chunks)

    monkeypatch.setattr(disk, "_write_file", slow_write)
    yield disk, release
    release.set()
    disk.close()


def test_put_returns_while_the_disk_hangs_and_queued_entries_are_served_from_memory(
    stalled: tuple[DiskTier, threading.Event],
) -> None:
    disk, release = stalled
    disk.put(MODEL, A, b"a")
    disk.put(MODEL, B, b"b")
    disk.put(MODEL, B, b"b again")  # already queued: skipped
    assert disk.load(MODEL, B) == b"b" and sorted(disk.keys(MODEL)) == [A, B] and disk.num_entries == 0
    release.set()
    disk.flush()
    assert disk.num_entries == 2 and disk.load(MODEL, B) == b"b" and disk.num_dropped == 0


@pytest.mark.parametrize(
    ("what", "states", "num_kept"),
    [
        ("more than 64 queued entries", [b"s"] * 70, 64),
        ("more than a quarter of the budget queued", [b"x" * 4000, b"x" * 4000, b"x" * 3000], 2),
        ("the first entry is queued whatever its size", [b"x" * 20_000, b"x"], 1),
    ],
)
def test_a_put_beyond_the_queue_limit_is_dropped_and_counted(
    stalled: tuple[DiskTier, threading.Event], what: str, states: list[bytes], num_kept: int
) -> None:
    disk, release = stalled
    for i, state in enumerate(states):
        disk.put(MODEL, (i,), state)
    assert disk.num_dropped == len(states) - num_kept and len(disk.keys(MODEL)) == num_kept
    release.set()
    disk.flush()
    assert disk.num_entries == num_kept


def test_stale_temporary_files_are_removed_when_the_root_is_indexed(tmp_path: Path) -> None:
    folder = tmp_path / prompt_disk._folder_name(MODEL)
    folder.mkdir()
    gone_writer = folder / ".abc.99999999.0a0b.tmp"  # no such process
    too_old = folder / f".abc.{os.getpid()}.0c0d.tmp"
    in_progress = folder / f".abc.{os.getpid()}.0e0f.tmp"
    unrelated = tmp_path / "notes.tmp"
    for path in (gone_writer, too_old, in_progress, unrelated):
        path.write_bytes(b"partial")
    os.utime(too_old, (0, 0))
    disk = DiskTier(tmp_path, 1 << 20)
    assert [p.exists() for p in (gone_writer, too_old, in_progress, unrelated)] == [False, False, True, True]
    assert disk.num_bytes == 0
    disk.close()


def test_concurrent_puts_and_loads_from_threads_keep_every_entry_whole(tier: DiskTier) -> None:
    wrong: list[tuple[int, ...]] = []

    def work(thread: int) -> None:
        for i in range(40):
            tokens = (i % 20, thread % 2)  # two threads share each key
            tier.put(MODEL, tokens, bytes(tokens) * 100)
            state = tier.load(MODEL, tokens)
            if state is not None and state != bytes(tokens) * 100:
                wrong.append(tokens)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.flush()
    keys = tier.keys(MODEL)
    assert not wrong and len(keys) == len(set(keys)) == tier.num_entries <= 40 <= tier.num_entries + tier.num_dropped
    assert all(tier.load(MODEL, tokens) == bytes(tokens) * 100 for tokens in keys)
    assert tier.num_bytes == sum(p.stat().st_size for p in entry_files(tier.root))


def test_a_removed_entry_is_gone_from_disk_and_from_the_queue(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "cache", 10_000)
    tier.put(MODEL, (1, 2), b"written")
    tier.flush()
    tier.remove(MODEL, (1, 2))
    assert tier.keys(MODEL) == [] and tier.num_bytes == 0
    tier.close()  # the writer unlinks removed files
    assert not list((tmp_path / "cache").rglob("*.state"))


def test_an_entry_removed_then_written_again_stays(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "cache", 10_000)
    tier.put(MODEL, (1, 2), b"first")
    tier.flush()
    tier.remove(MODEL, (1, 2))
    tier.put(MODEL, (1, 2), b"again")
    tier.close()
    assert DiskTier(tmp_path / "cache", 10_000).load(MODEL, (1, 2)) == b"again"
