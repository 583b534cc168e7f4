"""The on-fault NaN guard: a cheap check per pass, and a traced replay of the first failing one.

The contract: it names what the full trace names (the fault zoo, forward and backward), the
replay runs the same computation (inputs, dropout, autocast), the run continues bit for bit
after a replay, and a replay that sees no producer says so instead of naming one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.diagnostics import NonFiniteError, nan_guard
from mixprec.diagnostics._trace import hook_count

from . import zoo



def _key(ev):
    return (ev.phase, ev.module, ev.op, ev.node, ev.kind, ev.origin, ev.cause.code, ev.scaled, ev.step,
            tuple(str(r) for r in ev.inputs), str(ev.output))


def _train(task, recipe, guard, steps=1, **mp_kwargs):
    torch.manual_seed(0)
    model = task.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", nan_guard=guard, **mp_kwargs)
    mp.prepare(model)
    opt = task.build_optimizer(mp.parameters(model))
    for i in range(steps):
        inputs, targets = task.get_batch(i)
        with mp.autocast():
            loss = task.loss_fn(task.run_forward(model, inputs), targets)
        mp.step(loss, opt)
    return mp, model


def _both(task, recipe, steps=1, **kw):
    full, _ = _train(task, recipe, {"mode": "record", "trace": "every-step", **kw}, steps)
    cheap, _ = _train(task, recipe, {"mode": "record", "trace": "on-fault", **kw}, steps)
    return full.guard, cheap.guard


@pytest.mark.parametrize("factory,recipe", [
    ("make_log_zero", "fp16-mixed"),
    ("make_tiny_variance_norm", "fp16-mixed"),
    ("make_attention_overflow", "fp16-mixed"),
    ("make_nan_in_fp32", "fp32"),
    ("make_nan_in_fp32", "bf16-true"),
])
def test_on_fault_reports_what_the_full_trace_reports_on_the_fault_zoo(factory, recipe):
    full, cheap = _both(getattr(zoo, factory)(), recipe, steps=2)
    assert full.events, "the zoo's fault must show"
    assert [_key(e) for e in cheap.events] == [_key(e) for e in full.events]
    assert cheap.first.origin in ("producer", "constant") and cheap.first.replay.startswith("located by replaying step 1")
    assert [(e.module, e.op) for e in cheap.events[:1]] == [(full.first.module, full.first.op)]
    assert all(r.finite for r in cheap.first.inputs) and cheap.first.inputs == full.first.inputs


class WhereSqrt(nn.Module):
    """The classic NaN gradient: where() drops sqrt's NaN in the forward, but its backward computes
    0 * (0.5 / sqrt(x)) = NaN for x < 0, and that NaN reaches the weights."""

    def forward(self, x):
        return torch.where(x > 0, x.sqrt(), torch.zeros_like(x))


def _where_sqrt_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), WhereSqrt(), nn.Linear(3, 1))


def _task(build, loss_fn=F.mse_loss, n_in=3, n_out=1, forward=None):
    def get_batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.ones(4, n_in) + 0 * torch.rand(4, n_in, generator=g), torch.zeros(4, n_out)

    return mixprec.Task(name="t", build_model=build, get_batch=get_batch, loss_fn=loss_fn, steps=1, forward=forward,
                        build_optimizer=lambda p: torch.optim.SGD(p, lr=0.0))


class OwnLoss(nn.Module):
    """Returns (loss, logits) with the loss computed inside from the logits, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = _where_sqrt_net()

    def forward(self, x, y):
        logits = self.net(x)
        return F.mse_loss(logits, y), logits


def _own_loss_task():
    plain = _task(OwnLoss)
    return mixprec.Task(name="own-loss", build_model=OwnLoss, get_batch=lambda s: (plain.get_batch(s), None),
                        loss_fn=lambda out, _: out[0], forward=lambda m, inputs: m(*inputs), steps=1,
                        build_optimizer=plain.build_optimizer)


@pytest.mark.parametrize("name,task,recipe", [
    ("where(sqrt) in backward", lambda: _task(_where_sqrt_net), "fp32"),
    ("where(sqrt), bf16 storage", lambda: _task(_where_sqrt_net), "bf16-true"),
    ("where(sqrt), fp16 scaled", lambda: _task(_where_sqrt_net), "fp16-mixed"),
    ("loss outside the model", lambda: _task(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
                                             loss_fn=lambda out, y: (out - out.detach()).log().sum()), "fp32"),
    ("loss and logits returned", lambda: _own_loss_task(), "fp32"),
])
def test_on_fault_names_backward_producers_as_the_full_trace_does(name, task, recipe):
    full, cheap = _both(task(), recipe, steps=2)
    assert any(e.phase == "backward" for e in full.events)
    assert [_key(e) for e in cheap.events] == [_key(e) for e in full.events]
    back = next(e for e in cheap.events if e.phase == "backward")
    assert "the same parameters' gradients went non-finite" in back.replay
    assert "subtraction" not in back.replay  # the logits' gradient came from inside: nothing injected twice


def test_on_fault_names_faults_in_a_hugging_face_gpt2_like_the_full_trace():
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)

    def build():
        torch.manual_seed(0)
        m = tf.GPT2LMHeadModel(config)
        m.transformer.h[1].mlp.act = WhereSqrt()  # an activation whose backward is NaN below 0
        with torch.no_grad():
            m.transformer.h[0].mlp.c_fc.weight.mul_(1e6)  # its product passes fp16's 65504
        return m

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    task = mixprec.Task(name="gpt2", build_model=build, get_batch=lambda s: (ids, ids), steps=1,
                        forward=lambda m, x: m(input_ids=x, labels=x).loss, loss_fn=lambda loss, _: loss)
    firsts = {}
    for recipe in ("fp32", "fp16-mixed"):
        full, cheap = _both(task, recipe)
        assert [_key(e) for e in cheap.events] == [_key(e) for e in full.events], recipe
        firsts[recipe] = _key(full.first)[:6]
        print(recipe, [_key(e) for e in full.events])
    assert firsts["fp32"] == ("backward", "transformer.h.1.mlp.act", "sqrt", "SqrtBackward0", "nan", "producer")
    assert firsts["fp16-mixed"][:3] == ("forward", "transformer.h.0.mlp.c_fc", "addmm")


def test_hugging_face_t5s_contained_log_does_not_hide_an_overflow_after_it():
    """T5 takes the log of a 0 relative position on every step and masks it out: contained. An fp16
    overflow in a later feed-forward layer is the fault, in both trace modes (found by a probe)."""
    tf = pytest.importorskip("transformers")
    config = tf.T5Config(num_layers=2, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def build():
        torch.manual_seed(0)
        m = tf.T5ForConditionalGeneration(config)
        with torch.no_grad():
            m.encoder.block[1].layer[1].DenseReluDense.wi.weight.mul_(1e5)  # its outputs pass fp16's 65504
        return m

    task = mixprec.Task(name="t5", build_model=build, get_batch=lambda s: (ids, ids), steps=1,
                        forward=lambda m, x: m(input_ids=x, labels=x).loss, loss_fn=lambda loss, _: loss)
    full, cheap = _both(task, "fp16-mixed")
    for g in (full, cheap):
        assert (g.first.phase, g.first.module, g.first.op) == ("forward", "encoder.block.1.layer.1.DenseReluDense.wi", "linear")
        assert all(e.op != "log" for e in g.events)
        assert all(e.follows == g.first.where_text for e in g.events if e.phase == "backward")


class DropoutLog(nn.Module):
    """NaN exactly where dropout dropped element 0 of a row: the fault depends on the mask drawn."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        kept = self.drop(torch.ones_like(x))  # 0 or 2
        return self.lin(x) * torch.log(kept[:, :1] - 1.0) * 0.0 + kept  # log(-1) = NaN where dropped


def test_the_replay_draws_the_same_dropout_mask_and_leaves_the_rng_as_it_was():
    torch.manual_seed(0)
    net = DropoutLog()
    x = torch.ones(4, 8)
    with nan_guard(net, "record", trace="on-fault", max_replays=12) as g:
        for _ in range(12):
            net(x)
    after_guarded = torch.rand(3)
    assert 6 <= len(g.events) <= 12  # about one row in two drops element 0 each pass
    for ev in g.events:
        assert (ev.module, ev.op, ev.kind, ev.origin) == ("", "log", "nan", "producer"), ev.describe()
        assert "its outputs are the original's bit for bit" in ev.replay
    torch.manual_seed(0)
    plain = DropoutLog()
    for _ in range(12):
        plain(x)
    assert torch.equal(torch.rand(3), after_guarded)  # the replays put the RNG back


class Poisoned(nn.Module):
    """A dropout and batch-norm net; ``scale`` large makes the fp16 backward overflow (a scaled overflow)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))

    def forward(self, x):
        return self.body(x)


def test_a_run_continues_bit_for_bit_after_replays():
    def run(guard):
        torch.manual_seed(0)
        model = Poisoned()
        mp = mixprec.MixedPrecision("fp16-mixed", "cpu", nan_guard=guard, scaler={"init_scale": 2.0**40})
        mp.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        skipped = []
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 8, generator=g) * 100, torch.randn(16, 2, generator=g)
            with mp.autocast():
                out = model(x)
            skipped.append(bool(mp.step(F.mse_loss(out, y), opt).skipped))
        return mp, model, opt, skipped, torch.rand(3)

    mp, model, opt, skipped, rng = run({"mode": "raise", "trace": "on-fault"})
    _, plain, plain_opt, plain_skipped, plain_rng = run(False)
    assert skipped == plain_skipped and skipped[0]  # the scale overflowed: skipped, replayed, not raised
    assert mp.guard.replays >= 1 and all(e.scaled for e in mp.guard.events)
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):  # running stats included
        assert torch.equal(a, b)
    assert torch.equal(rng, plain_rng)  # the dropout masks of later steps are the unguarded run's
    for sa, sb in zip(opt.state.values(), plain_opt.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


class SavedBuffers(nn.Module):
    """Buffers the graph saves for backward: positions indexing an embedding through a buffer (BERT's
    ``position_ids``/``token_type_ids``) and a batch norm's running stats; a NaN (a log of a negative number)
    when the batch's first value is below -10."""

    def __init__(self, batch_norm=True):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.register_buffer("positions", torch.arange(16).unsqueeze(0), persistent=False)
        self.norm = nn.BatchNorm1d(8) if batch_norm else nn.GroupNorm(1, 8)
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        h = x + self.emb(self.positions[:, : x.shape[1]])  # the index is a view of the buffer: saved for backward
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.lin(h) * torch.log(x[:1, :1, :1] + 10.0)


@pytest.mark.parametrize("batch_norm", [True, False])
def test_a_forward_replay_leaves_the_buffers_the_graph_saved_untouched(batch_norm):
    # found by a probe on Hugging Face BERT and DistilBERT: the replay wrote the buffers back with copy_, which
    # bumped their version counters, and the step's backward then failed ("modified by an inplace operation")
    def run(guard):
        torch.manual_seed(0)
        model = SavedBuffers(batch_norm)
        mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard=guard)
        mp.prepare(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(4):
            x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i))
            x[0, 0, 0] = -20.0 if i == 1 else 0.0
            with mp.autocast():
                loss = model(x).square().mean()
            mp.step(loss, opt)
        return mp, model

    mp, model = run({"mode": "record", "trace": "on-fault"})
    _, plain = run(False)
    first = mp.guard.first
    assert mp.guard.replays >= 1 and (first.phase, first.module, first.op, first.origin) == ("forward", "", "log", "producer")
    # only a batch norm updates buffers in the forward; the replay's own restore used to look like one
    assert any("buffers were updated" in e.replay for e in mp.guard.events) == batch_norm
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):  # running stats included
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name  # NaNs too
    assert model.positions._version == 0


class FirstCallOnly(nn.Module):
    """NaN on its first call only: state the replay cannot restore (a Python counter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (float("nan") if self.calls == 1 else 1.0)


def test_a_fault_the_replay_does_not_reproduce_is_reported_unlocated_not_guessed():
    net = FirstCallOnly()
    with pytest.raises(NonFiniteError) as info:
        with nan_guard(net, "raise", trace="on-fault"):
            net(torch.ones(2, 4))
    ev = info.value.event
    assert (ev.origin, ev.module, ev.op, ev.cause.code) == ("unlocated", None, None, "unlocated")
    assert "did not reproduce" in ev.replay and "the model's output" in ev.replay
    assert "producer not located" in str(info.value) and "trace': 'every-step'" in str(info.value)
    assert hook_count(net) == 0


class MaskedScores(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        s = self.lin(x)
        return s.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))  # -inf asked for


def test_infinities_the_model_asks_for_are_replayed_once_then_expected():
    net = MaskedScores()
    with nan_guard(net, "raise", trace="on-fault") as g:
        for _ in range(4):
            net(torch.ones(4, 4))
    assert g.events == [] and g.replays == 1 and g.checks == 4


def test_on_fault_hooks_the_root_module_only_and_leaves_nothing():
    net = zoo.ClassifierWithLoss()
    g = nan_guard(net, trace="on-fault").attach()
    assert hook_count(net.body) == 0 and hook_count(net.criterion) == 0 and hook_count(net) > 0
    g.detach()
    assert hook_count(net) == 0
    x, y = zoo.make_log_zero().get_batch(0)[0]
    with pytest.raises(NonFiniteError):  # a replay attaches the full trace for the replay only
        with nan_guard(net, trace="on-fault"):
            net.half()(x.half(), y)
    assert hook_count(net) == 0


def test_after_max_replays_faults_are_reported_as_seen_not_replayed():
    # each step: the forward's NaN and the backward's (from the loss) are each located by a replay
    mp, _ = _train(zoo.make_nan_in_fp32(), "fp32", {"mode": "record", "trace": "on-fault", "max_replays": 3}, steps=4)
    assert [(e.phase, e.origin) for e in mp.guard.events] == [
        ("forward", "producer"), ("backward", "input"), ("forward", "producer"), ("backward", "unlocated"),
        ("forward", "unlocated"), ("backward", "unlocated"), ("forward", "unlocated"), ("backward", "unlocated")]
    assert mp.guard.replays == 3
    last = mp.guard.events[-1]
    assert "max_replays=3" in last.replay and last.step == 4 and "the gradients of" in last.replay


class Copying(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _where_sqrt_net()

    def forward(self, x):
        return self.net(x * 1.0)  # autograd keeps no reference to x itself


def test_an_input_changed_in_place_before_backward_is_named_in_the_event():
    net = Copying()
    x = torch.ones(2, 3)
    with nan_guard(net, "record", trace="on-fault") as g:
        out = net(x)
        x.mul_(1.0)  # same values, a new version: the replay says it ran on the new value
        out.sum().backward()
    ev = g.first
    assert (ev.phase, ev.op) == ("backward", "sqrt") and "an input was changed in place" in ev.replay


def test_parameters_stepped_inside_backward_are_named_in_the_event():
    net = _where_sqrt_net()
    def step_in_backward(p):
        with torch.no_grad():  # as torch.optim does: an optimizer run from a post-accumulate-grad hook
            p.add_(0.0)

    hooks = [p.register_post_accumulate_grad_hook(step_in_backward) for p in net[2].parameters()]
    with nan_guard(net, "record", trace="on-fault") as g:
        net(torch.ones(2, 3)).sum().backward()
    for h in hooks:
        h.remove()
    assert "parameters were changed after the forward" in g.first.replay


def test_two_forwards_before_one_backward_are_both_replayed():
    net = _where_sqrt_net()
    with nan_guard(net, "record", trace="on-fault") as g:
        bad = net(torch.ones(2, 3))
        fine = net(-torch.ones(2, 3))
        (bad.sum() + fine.sum()).backward()
    with nan_guard(net, "record", trace="every-step") as full:
        bad = net(torch.ones(2, 3))
        fine = net(-torch.ones(2, 3))
        (bad.sum() + fine.sum()).backward()
    assert [_key(e)[:7] + _key(e)[9:] for e in g.events] == [_key(e)[:7] + _key(e)[9:] for e in full.events]
    assert g.first.phase == "backward" and g.first.op == "sqrt"


def test_a_fault_in_the_second_micro_step_names_its_step():
    task = zoo.make_nan_in_fp32()
    torch.manual_seed(0)
    model = task.build_model()
    mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard={"mode": "record"}, accumulate=2)
    mp.prepare(model)
    opt = task.build_optimizer(model.parameters())
    x, y = task.get_batch(0)
    mp.step(F.cross_entropy(model(x.abs() + 1), y), opt)  # finite: sqrt of positives
    mp.step(F.cross_entropy(model(x), y), opt)
    assert mp.guard.first.step == 2 and mp.guard.first.op == "sqrt"


def test_trace_defaults_and_bad_values():
    assert mixprec.MixedPrecision("fp32", "cpu", nan_guard=True).prepare(nn.Linear(2, 2)) is not None
    mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard=True)
    mp.prepare(nn.Linear(2, 2))
    assert mp.guard.trace == "on-fault"
    assert nan_guard(nn.Linear(2, 2)).trace == "every-step"
    with pytest.raises(ValueError, match="trace 'always' is not one of every-step, on-fault"):
        nan_guard(nn.Linear(2, 2), trace="always")
    with pytest.raises(ValueError, match="max_replays must be an integer >= 1"):
        nan_guard(nn.Linear(2, 2), trace="on-fault", max_replays=0)


def test_outputs_fed_from_inside_get_only_their_outside_gradient_in_a_replay():
    from mixprec.diagnostics.replay import _external

    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)

    def outputs():
        logits = lin(x)
        return [F.mse_loss(logits, torch.zeros(4, 2)), logits]  # the loss is made from the logits

    def arrived(outside):
        outs, got = outputs(), {}
        for i, t in enumerate(outs):
            t.register_hook(lambda g, i=i: got.__setitem__(i, g))
        (outs[0] + (outs[1] * outside).sum()).backward()
        return outs, [got[0], got[1]]

    _, grads = arrived(torch.zeros(4, 2))  # the logits' gradient came from the loss only
    notes: list[str] = []
    outs = outputs()  # the replay's outputs
    roots, injected = _external(outs, grads, notes)
    assert roots == [outs[0]] and torch.equal(injected[0], grads[0]) and notes == []

    outside = torch.randn(4, 2)
    _, grads = arrived(outside)  # ... and from outside too: that part is injected, once
    roots, injected = _external(outputs(), grads, notes)
    assert len(roots) == 2 and torch.allclose(injected[1], outside, atol=1e-6) and "subtraction" in notes[0]


def _ddp_rank(rank: int, port: int, out: str) -> None:
    import json
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard="record")
        model = mp.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), parallel="ddp")
        y = torch.zeros(2, 1)
        if rank == 1:
            y[0, 0] = float("nan")  # only rank 1's loss is NaN; DDP averages the NaN into rank 0's gradients
        mp.step(((model(torch.ones(2, 4)) - y) ** 2).mean(), torch.optim.SGD(mp.parameters(model), lr=0.1))
        with open(f"{out}.{rank}", "w") as f:
            json.dump([e.to_dict() for e in mp.guard.events], f)
        dist.barrier()  # no rank tears its group down while the other still has work in flight (gloo aborts)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_under_ddp_the_rank_that_made_the_nan_names_it_and_the_others_say_it_came_in(tmp_path):
    import json
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_ddp_rank, args=(port, str(tmp_path / "events")), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"events.{r}").read_text()) for r in (0, 1))
    assert [(e["phase"], e["origin"], e["cause"]) for e in r1] == [("backward", "input", "nonfinite-gradient-from-loss")]
    # rank 0 made nothing non-finite; it sees the averaged NaN (checked after DDP's reduction) and says so
    assert [(e["phase"], e["origin"]) for e in r0] == [("backward", "unlocated")]
    assert "averaged over the ranks" in r0[0]["replay"] and "0.weight" in r0[0]["replay"]
