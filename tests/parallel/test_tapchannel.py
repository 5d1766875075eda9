import time

import pytest
import torch
import torch.distributed as dist

from codraft.parallel.tapchannel import TapChannel, TapChannelError, TapChannelTimeout, TapSpec, required_depth
from tests.distributed import run_workers

TRANSPORTS = ["shm", "pg", "host_staging"]
MAX_TOKENS, HIDDEN = 16, 8
TOKENS = [5, 16, 1, 9, 16, 3]  # per microbatch, up to MAX_TOKENS
SPEC = TapSpec(MAX_TOKENS, HIDDEN, torch.bfloat16)


def _layers(stage: int) -> list[int]:
    return [10 * stage + 1, 10 * stage + 2] if stage % 2 == 0 else [10 * stage + 1]  # one or two taps per stage


def _taps(step: int, stage: int, microbatch: int, tokens: int | None = None) -> dict[int, torch.Tensor]:
    """Random bit patterns (NaN payloads, -0, inf included), reproducible on the draft stage."""
    g = torch.Generator().manual_seed(1000 * step + 100 * stage + microbatch)
    n = TOKENS[microbatch] if tokens is None else tokens
    return {layer: torch.randint(-2**15, 2**15, (n, HIDDEN), dtype=torch.int16, generator=g).view(torch.bfloat16)
            for layer in _layers(stage)}


def _deliver(rank, world_size, transport):
    """Sources post as fast as the ring allows; the draft stage dawdles before each fetch. Two steps."""
    sources = {s: _layers(s) for s in range(world_size - 1)}
    ch = TapChannel(sources, SPEC, n_microbatches=len(TOKENS), transport=transport, timeout_s=10)
    times = []  # source: when each post returned; draft stage: when each fetch began
    for step in range(2):
        for m in range(len(TOKENS)):
            if rank in sources:
                ch.post(m, _taps(step, rank, m))
                times.append(time.monotonic())
                continue
            time.sleep(0.5 if step == m == 0 else 0.02)
            times.append(time.monotonic())
            got = ch.fetch(m)
            want = {k: v for s in sources for k, v in _taps(step, s, m).items()}
            assert sorted(got) == sorted(want), (step, m, sorted(got))
            for layer, t in got.items():
                assert t.dtype == SPEC.dtype and t.shape == (TOKENS[m], HIDDEN), (step, m, layer, t.shape)
                assert torch.equal(t.view(torch.int16), want[layer].view(torch.int16)), (step, m, layer)
        ch.reset()
    ch.close()
    return ch.transports, ch.depths, times


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_microbatch_arrives_once_in_order_bit_exact_while_sources_run_ahead(transport, pp):
    results = run_workers(_deliver, pp, transport, timeout=60)
    transports, depths, fetch_started = results[-1]
    assert transports == {s: transport for s in range(pp - 1)}
    for s in range(pp - 1):
        posted = results[s][2]
        if transport == "host_staging":  # the baseline blocks: no post returns before the previous fetch began
            assert depths[s] == 1 and all(p >= f for p, f in zip(posted[1:], fetch_started[:-1], strict=True))
        else:  # 1F1B depth pp - s: the whole ring was filled while the draft stage still slept
            assert depths[s] == pp - s and posted[depths[s] - 1] < fetch_started[0]


def _two_pipelines(rank, world_size):
    """World 4 as two pipelines of 2 whose stage order is not the global rank order: [3, 1] and [2, 0]."""
    pipelines = [[3, 1], [2, 0]]
    groups = [dist.new_group(p, sort_ranks=False) for p in pipelines]
    line = next(i for i, p in enumerate(pipelines) if rank in p)
    ch = TapChannel({0: _layers(0)}, SPEC, group=groups[line], depth=2, transport=["auto", "pg"][line], timeout_s=10)
    if ch.stage == 0:
        for m in range(3):
            ch.post(m, _taps(line, 0, m))  # the pipeline's index as the step seed: each pipeline has its own data
    else:
        for m in range(3):
            got, want = ch.fetch(m), _taps(line, 0, m)
            assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want), (line, m)
    ch.close()
    return ch.stage, ch.transports


def test_each_pipeline_of_a_larger_job_gets_its_own_channel_in_stage_order():
    results = run_workers(_two_pipelines, 4, timeout=60)
    assert [stage for stage, _ in results] == [1, 1, 0, 0]  # global ranks 3 and 2 are the sources
    assert [t for _, t in results] == [{0: "pg"}, {0: "shm"}, {0: "pg"}, {0: "shm"}]


def _reordered(rank, world_size, transport):
    ch = TapChannel({0: _layers(0)}, SPEC, depth=1, transport=transport, timeout_s=5)
    if rank == 0:
        ch.post(1, _taps(0, 0, 1, tokens=4))  # microbatch 1 before microbatch 0, into the same slot
        ch.close()
        return None
    with pytest.raises(TapChannelError) as err:
        ch.fetch(0)
    ch.close()
    return str(err.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reordered_post_is_caught_by_the_stamp_naming_stage_slot_and_microbatch(transport):
    msg = run_workers(_reordered, 2, transport, timeout=30)[1]
    assert "source stage 0, slot 0: expected step 0 microbatch 0 but found step 0 microbatch 1" in msg


def _dropped(rank, world_size, transport):
    ch = TapChannel({0: _layers(0)}, SPEC, depth=2, transport=transport, timeout_s=5)
    if rank == 0:
        try:
            for m in (0, 2, 3):  # microbatch 1 is lost
                ch.post(m, _taps(0, 0, m, tokens=4))
            ch.close()
        except TapChannelError:  # host_staging: the draft stage stops receiving after the fault
            pass
        return None
    ch.fetch(0)
    with pytest.raises(TapChannelError) as err:
        ch.fetch(1)
    ch.close()
    return str(err.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dropped_post_is_caught_by_the_stamp_of_the_next_post_into_its_slot(transport):
    msg = run_workers(_dropped, 2, transport, timeout=30)[1]
    found = "slot 0: expected step 0 microbatch 1 but found step 0 microbatch 2" if transport == "host_staging" \
        else "slot 1: expected step 0 microbatch 1 but found step 0 microbatch 3"
    assert f"source stage 0, {found}" in msg


def _missed_reset(rank, world_size, transport):
    ch = TapChannel({0: _layers(0)}, SPEC, depth=1, transport=transport, timeout_s=5)
    if rank == 0:
        ch.post(0, _taps(0, 0, 0, tokens=4))
        ch.reset()
        ch.post(0, _taps(1, 0, 0, tokens=4))
        ch.close()
        return None
    ch.fetch(0)  # the draft stage forgets reset(): the next step's microbatch 0 must not pass as a repeat
    with pytest.raises(TapChannelError) as err:
        ch.fetch(0)
    ch.close()
    return str(err.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stamps_from_another_step_are_an_ordering_fault(transport):
    msg = run_workers(_missed_reset, 2, transport, timeout=30)[1]
    assert "expected step 0 microbatch 0 but found step 1 microbatch 0" in msg


def _source_dies(rank, world_size, transport):
    ch = TapChannel({0: _layers(0)}, SPEC, depth=2, transport=transport, timeout_s=2)
    if rank == 0:
        return None  # the process exits without posting
    start = time.monotonic()
    with pytest.raises(TapChannelError) as err:
        ch.fetch(0)
    return type(err.value), str(err.value), time.monotonic() - start


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_source_fails_the_draft_stage_within_the_timeout(transport):
    kind, msg, waited = run_workers(_source_dies, 2, transport, timeout=30)[1]
    assert waited < 3.5 and "source stage 0" in msg and "step 0 microbatch 0" in msg
    if transport == "shm":  # shared memory cannot tell dead from slow; gloo reports a closed connection at once
        assert kind is TapChannelTimeout


def _source_stalls(rank, world_size, transport):
    ch = TapChannel({0: _layers(0)}, SPEC, depth=2, transport=transport, timeout_s=1.5)
    if rank == 0:
        time.sleep(3.0)  # alive but silent past the draft stage's deadline
        return None
    start = time.monotonic()
    with pytest.raises(TapChannelTimeout) as err:
        ch.fetch(0)
    return str(err.value), time.monotonic() - start


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stalled_source_makes_the_draft_stage_time_out(transport):
    msg, waited = run_workers(_source_stalls, 2, transport, timeout=30)[1]
    assert 1.4 < waited < 3.0
    assert "waited 1.5 s for source stage 0 to post step 0 microbatch 0" in msg


def _reader_stalls(rank, world_size, transport):
    ch = TapChannel({0: _layers(0)}, SPEC, depth=2, transport=transport, timeout_s=1.5)
    if rank == 1:
        time.sleep(3.0)  # the draft stage never fetches
        return None
    start = time.monotonic()
    for m in range(10):
        try:
            ch.post(m, _taps(0, 0, m % len(TOKENS)))
        except TapChannelTimeout as e:
            return m, str(e), time.monotonic() - start
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stalled_draft_stage_makes_the_source_time_out_once_its_ring_is_full(transport):
    m, msg, waited = run_workers(_reader_stalls, 2, transport, timeout=30)[0]
    # shm: the 2 slots; pg: 2 received into the draft stage's posted slots + 2 sends in flight; baseline: the one
    # received into its posted slot
    assert m == {"shm": 2, "pg": 4, "host_staging": 1}[transport]
    assert 1.4 < waited < 3.0 and "source stage 0 waited 1.5 s for the draft stage" in msg
    assert f"step 0 microbatch {m}" in msg


def _misshapen(rank, world_size):
    spec = TapSpec(4, HIDDEN, torch.bfloat16)
    ch = TapChannel({0: [1, 2]}, spec, n_microbatches=2, timeout_s=5)
    errors = []
    if rank == 0:
        def t(n, h=HIDDEN, dtype=torch.bfloat16):
            return torch.ones(n, h, dtype=dtype)
        bad = [{1: t(5), 2: t(5)}, {1: t(3, 7), 2: t(3, 7)}, {1: t(3, dtype=torch.float32), 2: t(3)},
               {1: t(3)}, {1: t(3), 2: t(2)}]
        for taps in bad:
            with pytest.raises(TapChannelError) as err:
                ch.post(0, taps)
            errors.append(str(err.value))
        ch.post(0, {1: t(3), 2: 2 * t(3)})
    else:  # the rejected posts wrote nothing: microbatch 0 arrives intact
        got = ch.fetch(0)
        assert torch.equal(got[1], torch.ones(3, HIDDEN, dtype=spec.dtype)) and torch.equal(got[2], 2 * got[1])
    ch.close()
    with pytest.raises(TapChannelError) as err:  # writer and reader disagree on the slot shape
        TapChannel({0: [1, 2]}, TapSpec(4 if rank == 0 else 6, HIDDEN), n_microbatches=2, timeout_s=5)
    errors.append(str(err.value))
    return ch.transports, errors


def test_misshapen_taps_and_disagreeing_slot_shapes_are_clear_errors():
    transports, errors = run_workers(_misshapen, 2, timeout=30)[0]
    assert transports == {0: "shm"}  # "auto" on one host
    too_long, hidden, dtype, missing, ragged, disagree = errors
    assert "source stage 0, microbatch 0: the tap of layer 1 is (5, 8)" in too_long and "tokens <= 4" in too_long
    assert "(3, 7)" in hidden and "torch.float32" in dtype and "layers [1], the stage owns [1, 2]" in missing
    assert "layer 2 is (2, 8)" in ragged and "same tokens for every layer" in ragged
    assert "arguments differ between stages" in disagree and "max_tokens=6" in disagree


def test_required_depth_covers_the_schedules_run_ahead():
    assert [required_depth("1F1B", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [required_depth("Schedule1F1B", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert required_depth("GPipe", 0, 4, 8) == 8
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        required_depth("Interleaved1F1B", 0, 4, 8)
