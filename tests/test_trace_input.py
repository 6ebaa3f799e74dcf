"""Trace files `kvtier replay` cannot replay: one line naming the file, the line and the field,
exit status 2 (a traceback with exit 1 used to say "corrupt", which is the verdict of --verify).

Issue 11 item 15: hash ids past int32 tokens, `input_length` 1e400, deeply nested JSON and a
request larger than the device pool each crashed the replay. The reader is tested directly;
the command in process (`kvtier.admin.cli.main`, the console script's entry point; nothing is
started when the input is refused) and, for two of them, as a child process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kvtier.admin.cli import main
from kvtier.manager import workloads
from kvtier.manager.workloads import TRACE_BLOCK_TOKENS, TraceError, WorkRequest, read_trace
from support import clean_env, kvtier_script, new_deployment_id

pytestmark = pytest.mark.fast

GOOD = '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}'

BAD_LINES = [
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1, 4194304]}',
     "line 2: hash_ids[1] = 4194304: must be <= 4194303 (its tokens, hash id x 512 + 0..511, "
     "must be int32 token ids)"),
    ('{"timestamp": 0, "input_length": 1e400, "hash_ids": [1]}',
     "line 2: input_length = Infinity: expected a non-negative integer"),
    ('{"timestamp": 1e400, "input_length": 1, "hash_ids": [1]}',
     "line 2: timestamp = Infinity: expected a non-negative integer"),
    ('{"input_length": 12.5, "hash_ids": [1]}',
     "line 2: input_length = 12.5: expected a non-negative integer"),
    ('{"input_length": "12", "hash_ids": [1]}',
     'line 2: input_length = "12": expected a non-negative integer'),
    ('{"input_length": -1, "hash_ids": [1]}',
     "line 2: input_length = -1: must be >= 0 and <= 16777216"),
    ('{"input_length": 1, "output_length": 1e30, "hash_ids": [1]}',
     "line 2: output_length = 1e+30: must be >= 0 and <= 9223372036854775807"),
    ('{"input_length": 1, "hash_ids": [true]}',
     "line 2: hash_ids[0] = true: expected a non-negative integer"),
    ('{"input_length": 1, "hash_ids": "1 2"}',
     'line 2: hash_ids = "1 2": expected a list of non-negative integers'),
    ('{"input_length": 1}', "line 2: hash_ids: missing"),
    ('{"hash_ids": [1]}', "line 2: input_length: missing"),
    ('{"input_length": 600, "hash_ids": [1]}',
     "line 2: input_length = 600 exceeds the 1 blocks of 512 tokens hash_ids names"),
    ("[" * 100000 + "]" * 100000, "line 2: not a trace record (JSON nested too deeply)"),
    ('{"a": ' * 100000 + "1" + "}" * 100000,
     "line 2: not a trace record (JSON nested too deeply)"),
    ("[1, 2]", "line 2: not a trace record (a JSON list, not an object)"),
    ("{nope", "line 2: not a trace record (not JSON: Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1))"),
]


def _trace(tmp_path: Path, bad: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n{bad}\n{GOOD}\n")
    return path


@pytest.mark.parametrize(("line", "expected"), BAD_LINES,
                         ids=[e.split(": ", 1)[1][:40] for _, e in BAD_LINES])
def test_a_bad_record_is_one_line_naming_line_and_field(tmp_path: Path, line: str,
                                                        expected: str) -> None:
    path = _trace(tmp_path, line)
    with pytest.raises(TraceError) as caught:
        list(read_trace(path))
    assert str(caught.value) == f"trace {path} {expected}"


def test_the_largest_hash_id_gives_int32_tokens(tmp_path: Path) -> None:
    largest = (2**31 - 1) // TRACE_BLOCK_TOKENS
    assert largest == workloads.MAX_TRACE_HASH_ID
    path = _trace(tmp_path, f'{{"input_length": 512.0, "hash_ids": [{largest}]}}')
    first, second, third = read_trace(path)
    assert (first.line, second.line, third.line) == (1, 2, 3)
    assert second.tokens[-1] == largest * TRACE_BLOCK_TOKENS + 511 <= 2**31 - 1
    assert len(second.tokens) == 512


def test_a_request_larger_than_the_device_pool_names_its_line() -> None:
    check_requests_fit = workloads.check_requests_fit
    requests = [WorkRequest(list(range(8)), 0, 0, 1), WorkRequest(list(range(17)), 0, 0, 5)]
    check_requests_fit(requests[:1], 4, 4, "t.jsonl")
    with pytest.raises(TraceError) as caught:
        check_requests_fit(requests, 4, 4, "t.jsonl")
    assert str(caught.value) == (
        "trace t.jsonl line 5: input_length = 17 needs 5 device blocks of 4 tokens but "
        "cache.device_blocks = 4")
    with pytest.raises(TraceError, match="request 2 of the built-in workload"):
        check_requests_fit(requests, 4, 4)


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        f'deployment_id = "{new_deployment_id("trace")}"\n'
        "[model]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 8\n"
        "[cache]\nblock_size = 64\ndevice_blocks = 16\nhost_blocks = 16\n"
        '[storage]\nbackend = "none"\n[workers]\ncount = 1\ndevice = "cpu"\n')
    return path


@pytest.mark.parametrize(("line", "expected"), [
    *BAD_LINES[:3], BAD_LINES[12],
    ('{"input_length": 1025, "hash_ids": [1, 2, 3]}',
     "line 2: input_length = 1025 needs 17 device blocks of 64 tokens but "
     "cache.device_blocks = 16"),
])
def test_kvtier_replay_refuses_the_trace_with_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, expected: str) -> None:
    path = _trace(tmp_path, line)
    assert main(["replay", "--trace", str(path), "--config", str(_config(tmp_path))]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"kvtier replay: trace {path} {expected}\n"


@pytest.mark.slow  # `kvtier replay` as a child process (imports torch)
@pytest.mark.parametrize("case", [0, 12])
def test_the_console_script_exits_2_without_a_traceback(tmp_path: Path, case: int) -> None:
    line, expected = BAD_LINES[case]
    path = _trace(tmp_path, line)
    result = subprocess.run(
        [str(kvtier_script()), "replay", "--trace", str(path), "--config",
         str(_config(tmp_path))], capture_output=True, text=True, timeout=120,
        env=clean_env(), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"kvtier replay: trace {path} {expected}\n"
