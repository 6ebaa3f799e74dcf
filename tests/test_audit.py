"""The sampled recompute audit's engine-free parts (`kvtier.engine.audit`): which requests are
drawn (probability and blocks-per-second cap), how two copies of a block compare (bitwise,
then the dtype's stated tolerance), the Prometheus figures, and `audit.*` configuration
errors. The audit inside vLLM is tested in tests/test_vllm.py (`--audit 1`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kvtier.engine.audit import (
    EQUAL,
    MISMATCH,
    TOLERANCE,
    WITHIN,
    AuditFigures,
    AuditSampler,
    compare_pages,
    parse_sample,
    scratch_key,
)
from kvtier.manager.config import ConfigError, load_config
from prometheus_client import CollectorRegistry, generate_latest

pytestmark = pytest.mark.fast


# --- audit.sample -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "rate"), [
    ("0", 0.0), ("1", 1.0), ("1/1", 1.0), ("1/1000", 0.001), ("3/4", 0.75), (" 0.25 ", 0.25),
    (0.5, 0.5), (0, 0.0), (1, 1.0)])
def test_sample_forms(text: str | float, rate: float) -> None:
    assert parse_sample(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["2", "-0.1", "1/0", "2/1", "-1/5", "a", "", "1/x", "nan",
                                  True])
def test_bad_samples_are_refused(text: str | float) -> None:
    with pytest.raises(ValueError, match="probability"):
        parse_sample(text)


@pytest.mark.parametrize(("env", "needle"), [
    ({"KVTIER_AUDIT__SAMPLE": "1/0"}, "audit.sample"),
    ({"KVTIER_AUDIT__SAMPLE": "1.5"}, "audit.sample"),
    ({"KVTIER_AUDIT__MAX_BLOCKS_PER_S": "-1"}, "audit.max_blocks_per_s"),
    ({"KVTIER_AUDIT__RATE": "1"}, "audit.rate"),
])
def test_config_errors_are_one_line_naming_the_key(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, env, check_resources=False)
    message = str(caught.value)
    assert "\n" not in message and needle in message, message


def test_config_reads_the_audit_section(tmp_path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[audit]\nsample = "1/1000"\nmax_blocks_per_s = 5.0\n')
    cfg = load_config(path, {}, check_resources=False)
    assert cfg.audit.rate == pytest.approx(0.001) and cfg.audit.max_blocks_per_s == 5.0
    assert load_config(None, {}, check_resources=False).audit.rate == 0.0  # off by default
    cfg = load_config(None, {"KVTIER_AUDIT__SAMPLE": "0.01"}, check_resources=False)
    assert cfg.audit.rate == pytest.approx(0.01)


# --- the sampler ------------------------------------------------------------------------------


def test_off_draws_nothing() -> None:
    s = AuditSampler(0.0, 0.0, seed=1)
    assert not any(s.draw(6) for _ in range(1000)) and s.drawn == 0


def test_one_in_one_draws_every_request() -> None:
    s = AuditSampler(1.0, 0.0, seed=1)
    assert all(s.draw(100) for _ in range(1000))


def test_rate_within_its_confidence_bound() -> None:
    # 1 in 10 over 2,000 draws: the count is Binomial(2000, 0.1), sd 13.4; 5 sd either side
    s = AuditSampler(0.1, 0.0, seed=3)
    n = sum(s.draw(1) for _ in range(2000))
    assert abs(n - 200) <= 5 * math.sqrt(2000 * 0.1 * 0.9), n


def test_cap_bounds_blocks_per_second() -> None:
    now = [0.0]
    s = AuditSampler(1.0, 10.0, seed=1, clock=lambda: now[0])
    audited = 0
    for _ in range(100):  # 100 s of requests of 4 blocks, 10 a second (40 blocks/s asked)
        for _ in range(10):
            audited += 4 * s.draw(4)
        now[0] += 1.0
    # 10 blocks/s over 100 s, plus the first second's credit and one request of debt
    assert 990 <= audited <= 10 * 100 + 10 + 4, audited
    assert s.capped > 0


def test_a_request_larger_than_the_cap_is_still_audited_now_and_then() -> None:
    now = [0.0]
    s = AuditSampler(1.0, 2.0, seed=1, clock=lambda: now[0])
    results = []
    for _ in range(20):
        results.append(s.draw(10))
        now[0] += 1.0
    assert results[0] and 3 <= sum(results) <= 5, results  # 10 blocks every 5 s


# --- comparing two copies ----------------------------------------------------------------------


def _page(values: torch.Tensor) -> np.ndarray:
    return values.contiguous().view(torch.uint8).numpy().copy()


def test_equal_bytes_are_equal() -> None:
    a = torch.randn(2, 64, dtype=torch.bfloat16)
    v = compare_pages(_page(a), _page(a.clone()), "bfloat16")
    assert (v.result, v.max_abs, v.max_rel) == (EQUAL, 0.0, 0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_one_ulp_is_within_tolerance(dtype: str) -> None:
    t = getattr(torch, dtype)
    held = torch.randn(4, 128, dtype=torch.float32).to(t)
    fresh = torch.nextafter(held, torch.full_like(held, math.inf))  # every element one ulp up
    v = compare_pages(_page(fresh), _page(held), dtype)
    assert v.result == WITHIN and 0 < v.max_rel <= TOLERANCE[dtype] and v.max_abs > 0


def test_other_values_mismatch() -> None:
    held = torch.randn(4, 128, dtype=torch.float32).to(torch.bfloat16)
    other = torch.randn(4, 128, dtype=torch.float32).to(torch.bfloat16)
    v = compare_pages(_page(other), _page(held), "bfloat16")
    assert v.result == MISMATCH and v.max_rel > TOLERANCE["bfloat16"] and v.max_abs > 0.1


def test_nan_is_a_mismatch() -> None:
    held = torch.randn(64, dtype=torch.float32).to(torch.float16)
    fresh = held.clone()
    fresh[3] = math.nan
    v = compare_pages(_page(fresh), _page(held), "float16")
    assert v.result == MISMATCH and v.max_rel == math.inf


def test_a_zero_block_against_nonzero_is_a_mismatch() -> None:
    held = torch.zeros(64, dtype=torch.bfloat16)
    fresh = held.clone()
    fresh[0] = 1.0
    assert compare_pages(_page(fresh), _page(held), "bfloat16").result == MISMATCH


def test_scratch_keys_are_keys_of_their_own() -> None:
    h = bytes(range(32))
    assert scratch_key(h) != h and len(scratch_key(h)) == 32 and scratch_key(h) == scratch_key(h)


def test_figures_in_prometheus() -> None:
    f = AuditFigures()
    held = torch.randn(64, dtype=torch.float32).to(torch.bfloat16)
    f.record(compare_pages(_page(held), _page(held), "bfloat16"), "host")
    f.record(compare_pages(_page(-held), _page(held), "bfloat16"), "storage")
    registry = CollectorRegistry()
    registry.register(f)
    text = generate_latest(registry).decode()
    assert 'kvtier_audit_blocks_total{result="equal",tier="host"} 1.0' in text
    assert 'kvtier_audit_blocks_total{result="mismatch",tier="storage"} 1.0' in text
    assert 'kvtier_audit_blocks_total{result="within_tolerance",tier="host"} 0.0' in text
    assert f.total(MISMATCH) == 1 and f.max_abs > 0 and "kvtier_audit_max_rel_diff" in text


def test_figures_in_status() -> None:
    f = AuditFigures()
    held = torch.randn(64, dtype=torch.float32).to(torch.bfloat16)
    f.record(compare_pages(_page(-held), _page(held), "bfloat16"), "host")
    st = f.status()
    assert st["blocks"]["mismatch"] == {"host": 1, "storage": 0}
    assert st["blocks"]["equal"] == {"host": 0, "storage": 0} and st["max_rel_diff"] > 0
