"""SGD and Lion under FSDP2: the same bits on 1, 2 and 4 gloo ranks as one unsharded optimizer, every state mode.

The model and gradients are tests/test_fsdp_state_modes.py's (rows of 1, 2 and 3 blocks, rows of one short
block, an empty shard on 4 ranks, 1-D biases); each rank's optimizer is stepped with the same gradients as
the unsharded one, and every parameter and state tensor (masters, remainders, momentum buffers and their
codes and scales), gathered, must be bitwise the unsharded one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import halfadam
import halfadam.distributed as hd
from conftest import needs_gloo
from test_fsdp_state_modes import fsdp, make_model, same, snapshot, train

pytestmark = [needs_gloo, pytest.mark.distributed]

OPTIMIZERS = {
    "sgd": lambda params, mode: halfadam.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                                             state_mode=mode),
    "sgd-plain": lambda params, mode: halfadam.SGD(params, lr=1e-2, weight_decay=0.01, state_mode=mode),
    "lion": lambda params, mode: halfadam.Lion(params, lr=1e-3, weight_decay=0.1, state_mode=mode),
}
CASES = [(name, mode) for name in OPTIMIZERS for mode in ("fp32", "split", "bf16", "compact", "tiny")]


def _worker(rank, world, out):
    results = {}
    for name, mode in CASES:
        model = fsdp(make_model(torch.bfloat16))
        opt = OPTIMIZERS[name](model.parameters(), mode)
        train(model, opt)
        results[(name, mode)] = snapshot(model, opt)
    if rank == 0:
        torch.save(results, Path(out) / f"w{world}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_rules")
    single = {}
    for name, mode in CASES:
        model = make_model(torch.bfloat16)
        opt = OPTIMIZERS[name](model.parameters(), mode)
        train(model, opt)
        single[(name, mode)] = snapshot(model, opt)
    ranks = {}
    for world in (1, 2, 4):
        hd.launch(_worker, world, str(out), timeout_s=120)
        ranks[world] = torch.load(Path(out) / f"w{world}.pt", weights_only=False)
    return single, ranks


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_sharded_state_is_bitwise_the_unsharded_one(runs, case):
    single, ranks = runs
    expected = single[case]
    name, mode = case
    moment = {"sgd": "momentum_buffer", "lion": "exp_avg"}.get(name)
    if moment:
        assert f"0.weight.{moment}" in expected
        if mode in ("compact", "tiny"):
            assert expected[f"0.weight.{moment}"].dtype == torch.uint8 and f"0.weight.{moment}_scale" in expected
    else:
        assert not any(k.endswith(("momentum_buffer", "exp_avg")) for k in expected)
    for world in (1, 2, 4):
        assert same(ranks[world][case], expected), f"{world} ranks"
