"""A group's prompt laid out once gives the rows' logits, taps and gradients."""

import torch

from codraft.models import ModelArgs, Transformer
from codraft.models.shared_prefix import shared_prefix_forward, shared_prefix_layout
from codraft.rl.batch import pack_rollouts, whole_view

PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [12, 13], [12, 13]]  # groups of 3, 1 and 2 rows
ANSWERS = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [31, 32, 33], [34, 35]]


def tiny() -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2)
    return Transformer(args).double()


def rows_and_layout():
    packed = pack_rollouts(PROMPTS, ANSWERS, [[0.0] * len(a) for a in ANSWERS])
    view = whole_view(packed)
    layout = shared_prefix_layout(PROMPTS, ANSWERS)
    return view, layout


def test_the_layout_holds_each_prompt_once_and_maps_back_to_every_row_s_tokens():
    view, layout = rows_and_layout()
    assert layout.input_ids.numel() == 4 + 9 + 3 + 2 + 2 + 5  # each group's prompt once, every answer
    assert torch.equal(layout.input_ids[0, layout.gather], view.input_ids)
    assert torch.equal(layout.positions[0, layout.gather], view.positions)
    assert shared_prefix_layout([[1, 2], [3, 4]], [[5], [6]]) is None  # no shared prompt: nothing to lay out


def test_an_answer_sees_the_prompt_and_its_own_earlier_tokens_only():
    _, layout = rows_and_layout()  # group 0: prompt 0-3, answers 4-6, 7, 8-12
    torch.manual_seed(0)
    q, k, v = torch.randn(25, 4, 8, dtype=torch.float64), *torch.randn(2, 25, 2, 8, dtype=torch.float64)
    base = layout.attention(q, k, v, layout.cu_seqlens)

    def changed(at: int) -> torch.Tensor:  # which outputs move when token `at`'s value changes
        moved = v.clone()
        moved[at] += 1
        return (layout.attention(q, k, moved, layout.cu_seqlens) - base).abs().amax((1, 2)) > 0

    assert changed(2)[2:13].all() and not changed(2)[:2].any() and not changed(2)[13:].any()  # the prompt: all after
    assert changed(5)[5:7].all() and changed(5).sum() == 2  # answer 1: its own later tokens only
    assert changed(9)[9:13].all() and changed(9).sum() == 4  # answer 3: its own later tokens only
    assert changed(7)[7] and changed(7).sum() == 1


def test_logits_taps_and_gradients_equal_the_rows_layout():
    view, layout = rows_and_layout()
    rows = view.logit_rows()
    outs, grads = [], []
    for shared in (False, True):
        model = tiny()
        if shared:
            out = shared_prefix_forward(model, layout, (1, 2), rows)
        else:
            out = model(view.input_ids[None], positions=view.positions[None], cu_seqlens=view.cu_seqlens,
                        taps=(1, 2), logit_rows=rows)
        weights = torch.linspace(-1, 1, out.logits.shape[-1], dtype=out.logits.dtype)
        loss = (out.logits[0, rows].log_softmax(-1) * weights).sum() + out.taps[1].pow(2).mean()
        loss.backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    rows_out, shared_out = outs
    torch.testing.assert_close(shared_out.logits, rows_out.logits)
    torch.testing.assert_close(shared_out.hidden, rows_out.hidden)
    for layer in (1, 2):
        torch.testing.assert_close(shared_out.taps[layer], rows_out.taps[layer])
    # a prompt token's gradient is one backward of the sum over its copies instead of a sum of backwards; RMSNorm
    # normalises in fp32 also for this fp64 model, so the two differ at fp32 rounding (~1e-7 of the largest entry)
    assert grads[0].keys() == grads[1].keys()
    for name, rows_grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], rows_grad, rtol=1e-6, atol=1e-6 * float(rows_grad.abs().max()),
                                   msg=name)
