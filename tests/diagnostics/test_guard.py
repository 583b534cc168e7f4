"""The NaN guard names the producer (module, op, kind, cause), forward and backward, and leaves no hooks."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.diagnostics import NanGuard, NonFiniteError, NonFiniteWarning, nan_guard
from mixprec.diagnostics._trace import hook_count
from mixprec.tasks import load_task

from . import zoo


def _guarded_step(task, recipe, mode="record", **mp_kwargs):
    torch.manual_seed(0)
    model = task.build_model()
    mp = mixprec.MixedPrecision(recipe, "cpu", **mp_kwargs)
    mp.prepare(model)
    inputs, targets = task.get_batch(0)
    with nan_guard(model, mode, scaler=mp.scaler) as guard:
        with mp.autocast():
            loss = task.loss_fn(task.run_forward(model, inputs), targets)
        mp.step(loss, task.build_optimizer(model.parameters()))
    return guard, loss.detach()


@pytest.mark.parametrize("factory,module,op,kind,cause", [
    ("make_log_zero", "criterion", "log", "inf", "log-of-zero"),
    ("make_tiny_variance_norm", "norm", "div", "nan", "division-by-zero"),
    ("make_attention_overflow", "attn", "matmul", "inf", "matmul-overflow"),
])
def test_guard_names_the_producing_module_op_and_cause_of_fp16_faults(factory, module, op, kind, cause):
    guard, loss = _guarded_step(getattr(zoo, factory)(), "fp16-mixed")
    assert not math.isfinite(float(loss))
    ev = guard.first
    assert (ev.phase, ev.module, ev.op, ev.kind, ev.origin) == ("forward", module, op, kind, "producer")
    assert ev.cause.code == cause
    assert ev.dtype == torch.float16
    assert ev.where is not None and ev.where.startswith("zoo.py:")
    assert all(r.finite for r in ev.inputs)  # a producer: what it received was finite


@pytest.mark.parametrize("factory", ["make_log_zero", "make_tiny_variance_norm", "make_attention_overflow"])
def test_guard_reports_nothing_for_the_same_model_in_fp32(factory):
    guard, loss = _guarded_step(getattr(zoo, factory)(), "fp32")
    assert math.isfinite(float(loss))
    assert guard.events == []


def test_guard_finds_a_nan_that_fp32_has_too():
    guard, _ = _guarded_step(zoo.make_nan_in_fp32(), "fp32")
    ev = guard.first
    assert (ev.module, ev.op, ev.kind, ev.cause.code) == ("features", "sqrt", "nan", "sqrt-of-negative")
    assert ev.inputs[0].min < 0


@pytest.mark.parametrize("recipe", ["fp32", "fp16-mixed"])
def test_guard_is_silent_on_the_builtin_task_with_its_minus_inf_causal_mask(recipe):
    task = load_task(None, batch_size=2, seq_len=16)
    guard, loss = _guarded_step(task, recipe, mode="raise")  # would raise on any producer
    assert math.isfinite(float(loss))
    assert guard.checks >= 2 and guard.events == []


def test_guard_is_silent_when_the_loss_scale_overflows_the_gradients_and_the_step_reads_them():
    # A scale too large for this step: fp16 backward overflows, the scaler skips. The step then
    # reads p.grad (inf) inside the guard's block: a property read, not an op making an infinity.
    # (It was reported as "Inf produced in forward by code outside the model, op get" whenever the
    # default 2**16 overflowed at step 1, which depends on the batch and the CPU's kernels.)
    task = load_task(None, batch_size=2, seq_len=16)
    guard, loss = _guarded_step(task, "fp16-mixed", mode="raise", scaler={"init_scale": 2.0**60})
    assert math.isfinite(float(loss))
    assert all(ev.scaled for ev in guard.events)  # the scaler's own overflow: reported, never raised
    assert guard.events  # and it did overflow


class Chain(nn.Module):
    """a -> bad (makes inf from finite) -> c -> d: the NaN/Inf flows through c and d."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.bad = Exploder()

    def forward(self, x):
        return self.d(self.c(self.bad(self.a(x))))


class Exploder(nn.Module):
    def forward(self, x):
        return x * 1e38 * 1e38  # overflows fp32


def test_guard_blames_the_producer_not_the_modules_the_inf_flowed_through():
    net = Chain()
    with nan_guard(net, "record") as g:
        net(torch.ones(2, 4))
    ev = g.first
    assert (ev.module, ev.module_type, ev.op, ev.kind) == ("bad", "Exploder", "mul", "inf")
    assert len(g.events) == 1


def test_guard_without_ops_names_the_module_whose_output_went_bad():
    net = Chain()
    with nan_guard(net, "record", ops=False) as g:
        net(torch.ones(2, 4))
    assert (g.first.module, g.first.op) == ("bad", None)


def test_raise_mode_raises_at_the_end_of_the_forward_with_the_event():
    net = Chain()
    with pytest.raises(NonFiniteError) as info:
        with nan_guard(net):
            net(torch.ones(2, 4))
            pytest.fail("the forward should have raised")
    assert info.value.event.module == "bad"
    assert "bad (Exploder), op mul" in str(info.value)
    assert hook_count(net) == 0  # the context exit cleaned up despite the exception


def test_warn_mode_warns_once_per_place():
    net = Chain()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_guard(net, "warn") as g:
            for _ in range(3):
                net(torch.ones(2, 4))
    ours = [w for w in caught if issubclass(w.category, NonFiniteWarning)]
    assert len(ours) == 1 and "bad (Exploder)" in str(ours[0].message)
    assert len(g.events) == 3  # every pass is still recorded


class SqrtAtZero(nn.Module):
    def forward(self, x):
        return torch.sqrt(x.relu())  # finite forward; d sqrt / dx at 0 is inf


def _sqrt_at_zero_net():
    """Linear (weights -1) -> sqrt(relu) -> Linear: inputs of ones reach sqrt(0)."""
    net = nn.Sequential(nn.Linear(3, 3), SqrtAtZero(), nn.Linear(3, 1))
    with torch.no_grad():
        net[0].weight.fill_(-1.0)
        net[0].bias.zero_()
    return net


def test_guard_names_the_backward_producer_and_its_node():
    net = _sqrt_at_zero_net()
    with nan_guard(net, "record") as g:
        net(torch.ones(2, 3)).sum().backward()
    ev = g.first
    assert (ev.phase, ev.module, ev.op, ev.kind) == ("backward", "1", "sqrt", "inf")
    assert ev.node.startswith("SqrtBackward")
    assert all(r.finite for r in ev.inputs)  # the gradient that came in was finite
    assert "gradients in:" in ev.describe()
    assert ev.cause.code == "sqrt-of-zero"


def test_backward_through_two_forwards_watches_both_graphs():
    net = _sqrt_at_zero_net()
    with nan_guard(net, "record") as g:
        bad = net(torch.ones(2, 3))  # relu(-3) = 0: sqrt's backward is inf here
        fine = net(-torch.ones(2, 3))  # the second forward must not unhook the first graph
        (bad.sum() + fine.sum()).backward()
    assert (g.first.phase, g.first.module, g.first.op) == ("backward", "1", "sqrt")


def test_guard_names_an_op_in_a_loss_computed_outside_the_model():
    net = nn.Linear(2, 2)
    with nan_guard(net, "record") as g:
        out = net(torch.ones(1, 2))
        (out - out).log().sum()  # log(0) in the loss: no module runs it
    ev = g.first
    assert (ev.module, ev.op, ev.cause.code) == (None, "log", "log-of-zero")


def test_non_finite_batch_is_reported_as_arriving_not_produced():
    net = Chain()
    x = torch.ones(2, 4)
    x[0, 0] = float("nan")
    with nan_guard(net, "record") as g:
        net.a(x)  # a submodule alone: the guard still sees it
        net(x)
    assert g.first.origin == "input" and g.first.kind == "nan"
    assert g.first.cause.code == "nonfinite-input"


class MaskModule(nn.Module):
    def forward(self, x):
        return x.masked_fill(x < 0, float("-inf"))  # intentional -inf


class UsesMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = MaskModule()

    def forward(self, x):
        return self.mask(x).softmax(-1)


def test_an_infinity_passed_as_a_value_is_intentional_and_not_reported():
    with nan_guard(UsesMask(), "raise") as g:
        g.model(torch.tensor([[1.0, -1.0, 2.0]]))
    assert g.events == []


class MaskOut(nn.Module):  # the -inf reaches the model's output: it leaves the forward
    def __init__(self):
        super().__init__()
        self.mask = MaskModule()

    def forward(self, x):
        return self.mask(x)


def test_allow_list_covers_a_module_whose_output_is_minus_inf_on_purpose():
    x = torch.tensor([[1.0, -1.0, 2.0]])
    with nan_guard(MaskOut(), "record", ops=False) as g:
        g.model(x)
    assert g.first.module == "mask"  # module-level view: finite in, -inf out
    with nan_guard(MaskOut(), "raise", ops=False, allow=["mask:"]) as g:
        g.model(x)
    assert g.events == []
    with nan_guard(UsesMask(), "raise", ops=False) as g:  # softmax makes it finite again: contained
        g.model(x)
    assert g.events == [] and g.contained[0].module == "mask"


def test_allowed_infinity_that_turns_into_nan_later_is_still_reported():
    class Later(nn.Module):
        def __init__(self):
            super().__init__()
            self.mask = MaskModule()

        def forward(self, x):
            return self.mask(x) * 0.0  # -inf * 0 = NaN: a real fault downstream of an allowed inf

    with nan_guard(Later(), "record") as g:
        g.model(torch.tensor([[1.0, -1.0]]))
    assert (g.first.op, g.first.kind, g.first.cause.code) == ("mul", "nan", "inf-arithmetic")


def test_scaled_backward_overflow_is_recorded_but_never_raised():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**100)
    with torch.no_grad():  # the scaled loss stays finite (~4e34); the gradient of net[0] passes fp32's max
        net[0].weight.fill_(1e-6)
        net[0].bias.zero_()
        net[1].weight.fill_(1e6)
    with nan_guard(net, "raise", scaler=scaler) as g:
        scaler.scale(net(torch.full((2, 4), 1e3)).sum()).backward()
    assert g.first.phase == "backward" and g.first.scaled and g.first.module == "0"
    assert g.first.scale == 2.0**100 and g.first.cause.code == "scaled-gradient-overflow"


def test_mixed_precision_flag_attaches_the_guard_and_off_adds_no_hooks():
    def fresh():
        torch.manual_seed(0)
        return zoo.ClassifierWithLoss()

    plain = mixprec.MixedPrecision("fp16-mixed", "cpu").prepare(fresh())
    baseline = hook_count(plain)  # the recipe's own hooks (output cast)
    mp = mixprec.MixedPrecision("fp16-mixed", "cpu", nan_guard=True)
    model = mp.prepare(fresh())
    assert isinstance(mp.guard, NanGuard) and hook_count(model) > baseline
    x, y = zoo.make_log_zero().get_batch(0)[0]
    with pytest.raises(NonFiniteError, match="criterion"):
        with mp.autocast():
            model(x, y)
    mp.guard.detach()
    assert hook_count(model) == baseline
    assert mixprec.MixedPrecision("fp32", "cpu", nan_guard=False).guard is None


def test_flag_guard_says_a_non_finite_gradient_came_from_a_loss_outside_the_model():
    mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard="record")
    net = mp.prepare(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    out = net(torch.ones(3, 2))
    loss = (out - out.detach()).log().sum()  # log(0) outside the model: the guard does not watch it
    mp.step(loss, torch.optim.SGD(net.parameters(), lr=0.1))
    ev = mp.guard.first
    assert (ev.phase, ev.origin, ev.module) == ("backward", "input", "1")
    assert ev.cause.code == "nonfinite-gradient-from-loss"


def test_mixed_precision_flag_accepts_a_mode_or_options_and_rejects_other_values():
    mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard="record")
    mp.prepare(nn.Linear(2, 2))
    assert mp.guard.mode == "record"
    mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard={"mode": "warn", "ops": False})
    mp.prepare(nn.Linear(2, 2))
    assert mp.guard.mode == "warn" and not mp.guard._tracer.ops
    with pytest.raises(TypeError, match="nan_guard must be"):
        mixprec.MixedPrecision("fp32", "cpu", nan_guard=3).prepare(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not one of raise, warn, record"):
        nan_guard(nn.Linear(2, 2), "explode")


def test_no_hooks_remain_after_the_context_and_the_module_stack_survives_exceptions():
    net = Chain()
    before = hook_count(net)
    with nan_guard(net, "record") as g:
        with pytest.raises(RuntimeError):
            net(torch.ones(2, 5))  # shape error inside net.a
        assert g._tracer.stack == []  # always_call post hooks popped every module
        net(torch.ones(2, 4))
    assert g.first.module == "bad"
    assert hook_count(net) == before == 0
    assert g._tracer._node_handles == [] and g._tracer._mode is None and g._tracer._token == 0


def test_event_description_names_place_dtype_and_input_range():
    guard, _ = _guarded_step(zoo.make_attention_overflow(), "fp16-mixed")
    text = guard.first.describe()
    assert "attn (SelfAttention), op matmul" in text
    assert "f16[8x2x12x12] holding -inf and inf" in text  # q @ k.T overflowed both ways
    assert "inputs: f16[8x2x12x16] in [" in text
    assert "matmul-overflow" in text and "fix:" in text


@pytest.mark.cuda
def test_guard_names_the_attention_overflow_on_cuda_in_fp16():
    task = zoo.make_attention_overflow()
    torch.manual_seed(0)
    model = task.build_model().cuda()
    mp = mixprec.MixedPrecision("fp16-mixed", "cuda")
    mp.prepare(model)
    x, y = (t.cuda() for t in task.get_batch(0))
    with nan_guard(model, "record", scaler=mp.scaler) as g:
        with mp.autocast():
            task.loss_fn(model(x), y)
    assert (g.first.module, g.first.op, g.first.kind, g.first.cause.code) == ("attn", "matmul", "inf", "matmul-overflow")


@pytest.mark.cuda
def test_tracer_adds_no_host_sync_per_op_or_node_on_cuda():
    from mixprec.diagnostics._trace import Tracer

    task = load_task(None, batch_size=4, seq_len=32)
    torch.manual_seed(0)
    model = task.build_model().cuda()
    x, y = (t.cuda() for t in task.get_batch(0))
    tracer = Tracer(model, outside_modules=True).attach()  # no checks: nothing reads the device
    tracer.enter_scope()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        task.loss_fn(model(x), y).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        tracer.exit_scope()
        tracer.detach()
    records, ranges = tracer.take()  # the one sync
    assert len(records) > 50 and any(r.phase == "backward" for r in records)
    assert not any(r.nan for r in ranges) and any(r.inf for r in ranges)  # the causal mask's -inf


class TimesNan(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * float("nan")  # a NaN number in the code


def test_guard_names_the_op_that_multiplied_by_a_nan_number_not_the_loss():
    net = TimesNan()
    with nan_guard(net, "record") as g:
        F.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 4)).backward()
    ev = g.first
    assert (ev.phase, ev.module, ev.op, ev.kind, ev.origin) == ("forward", "", "mul", "nan", "constant")
    assert ev.cause.code == "nan-constant" and "NaN produced" in ev.describe()


def test_guard_names_the_parameter_that_holds_the_nan_it_received():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        net[1].weight[0, 0] = float("nan")  # e.g. left by an earlier step or a checkpoint
    with nan_guard(net, "record") as g:
        net(torch.ones(2, 4))
    ev = g.first
    assert ev.origin == "input" and ev.held_by == ("parameter '1.weight'",)
    assert ev.cause.code == "nonfinite-parameter" and "'1.weight'" in ev.describe()


def test_an_infinity_passed_as_a_number_is_still_asked_for():
    net = nn.Linear(4, 4)
    with nan_guard(net, "record") as g:
        out = net(torch.ones(2, 4))
        out.masked_fill(torch.ones(2, 4, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    assert g.events == []


class MaskedLog(nn.Module):
    """T5's relative-position buckets: log of a tensor holding 0, the -inf masked out by torch.where."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        pos = torch.arange(4.0)
        big = torch.log(pos / 2)  # -inf at 0
        bucket = torch.where(pos < 2, pos, big).clamp_min(0)  # the -inf never leaves
        return self.lin(x) + bucket


def test_a_non_finite_value_dropped_inside_the_forward_is_contained_not_raised():
    net = MaskedLog()
    with nan_guard(net, "raise") as g:
        F.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 4)).backward()
    assert g.events == [] and len(g.contained) == 1
    assert (g.contained[0].op, g.contained[0].kind) == ("log", "inf")


class Bucketed(nn.Module):
    """T5's layout: an attention-like module whose masked log(0) never leaves it, then a layer that overflows."""

    def __init__(self):
        super().__init__()
        self.attn = MaskedLog()
        self.ff = nn.Linear(4, 4)

    def forward(self, x):
        return self.ff(self.attn(x))


@pytest.mark.parametrize("trace", ["every-step", "on-fault"])
def test_a_contained_value_before_the_real_fault_does_not_take_its_blame(trace):
    # found by a probe on Hugging Face T5: its contained log(0) came first in the pass, and once anything
    # non-finite reached the output the guard named the log (cause log-of-zero, fix: fp32 T5Attention);
    # the real producer, an overflowing linear later on, was in no event
    torch.manual_seed(0)
    net = Bucketed()
    mp = mixprec.MixedPrecision("fp32", "cpu", nan_guard={"mode": "record", "trace": trace})
    mp.prepare(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with torch.no_grad():
        net.ff.weight.fill_(1e38)
    with mp.autocast():
        loss = net(torch.full((2, 4), 10.0)).sum()
    mp.step(loss, opt)
    g = mp.guard
    assert (g.first.phase, g.first.module, g.first.op, g.first.origin) == ("forward", "ff", "linear", "producer")
    assert all(e.op != "log" for e in g.events)
    if trace == "every-step":  # the on-fault guard's replays keep no contained events of their own
        assert any(e.op == "log" for e in g.contained)


def test_a_backward_fault_after_a_forward_fault_of_the_same_step_is_its_consequence():
    # found by the same probe: the NaN through cross_entropy's backward after a forward NaN was blamed on a
    # log of 0 ("the backward of log divides by its input, which held 0"); nothing held 0
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    net[0].register_forward_hook(lambda m, i, o: o * float("nan"))
    with nan_guard(net, "record") as g:
        F.cross_entropy(net(torch.ones(2, 4)), torch.tensor([0, 1])).backward()
    fwd, bwd = g.events[0], g.events[-1]
    assert fwd.phase == "forward" and bwd.phase == "backward" and bwd.follows == fwd.where_text
    assert bwd.cause.code == "follows-forward-fault" and "consequence" in bwd.describe()
    with nan_guard(net, "record") as g2:  # a step of its own: a backward fault with no forward one has its own cause
        net[0]._forward_hooks.clear()
        (net(torch.ones(2, 4)).sqrt() * 0).sum().backward()
    assert all(e.follows is None for e in g2.events)


class InPlaceOverflow(nn.Module):
    """The first op's output is finite; an in-place op later makes it infinite."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)  # passes inplace as a keyword: F.relu(x, inplace=True)
        self.drop = nn.Dropout(0.0, inplace=True)  # passes it positionally: F.dropout(x, p, training, True)

    def forward(self, x):
        h = self.drop(self.act(self.lin(x)))
        h[0, 0] = 1.0
        h.mul_(1e30)  # finite
        h.mul_(1e30)  # overflows fp32: the producer
        return h


def test_a_value_overwritten_in_place_is_measured_before_the_op_that_overwrites_it():
    # Small tensors are measured lazily at the check; an in-place op must not change what an
    # earlier op is recorded to have made (the first mul_ would be blamed for the second's inf).
    net = InPlaceOverflow()
    with nan_guard(net, "record") as g:
        net(torch.ones(2, 4))
    ev = g.first
    assert (ev.module, ev.op, ev.kind, ev.origin) == ("", "mul", "inf", "producer")  # (op names drop the _)
    assert ev.inputs[0].finite and ev.inputs[0].max >= 1e30  # what the second mul_ received: h after the first


class _ResidualSqrt(nn.Module):
    """sqrt(relu(.)) at zero (an inf gradient in backward) behind a residual add, a cat, a negation
    and scalings by 0.5: each only routes (or shrinks) its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.fill_(-1.0)

    def forward(self, x):
        h = torch.sqrt(torch.relu(self.lin(x))) * 0.5 + x
        return torch.tanh(torch.cat([h, -h], dim=1) / 2.0)  # tanh consumes the rest: nothing unwatched after it


def test_routing_nodes_are_walked_through_and_the_producer_behind_them_is_named():
    net = _ResidualSqrt()
    with nan_guard(net, "record") as g:
        net(torch.ones(2, 3)).sum().backward()
    ev = g.first  # the cat's two halves come back as +1 and -1: sqrt's backward sees 0 / 0
    assert (ev.phase, ev.origin, ev.op, ev.kind) == ("backward", "producer", "sqrt", "nan")
    assert ev.node.startswith("SqrtBackward") and all(r.finite for r in ev.inputs)

    from mixprec.diagnostics._trace import Tracer

    tracer = Tracer(net, lazy=True).attach()
    try:
        net(torch.ones(2, 3)).sum().backward()
        records, _ = tracer.take()
    finally:
        tracer.detach()
    nodes = {r.node for r in records if r.phase == "backward"}
    assert "SqrtBackward0" in nodes and "TanhBackward0" in nodes, nodes
    assert not nodes & {"AddBackward0", "CatBackward0", "NegBackward0", "MulBackward0", "DivBackward0"}, nodes


@pytest.mark.parametrize("factor", [1e30, -1e30])
def test_a_scaling_by_more_than_one_stays_hooked_its_gradient_can_overflow(factor):
    net = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        net[0].weight.fill_(0.25)
        net[0].bias.zero_()
    net.forward = lambda x: torch.tanh(net[0](x) * factor)  # forward: tanh(0.1); backward: 1e10 * 1e30 overflows
    seed = torch.full((1, 2), 1e10)
    with nan_guard(net, "record") as g:
        net(torch.full((1, 2), 2e-31)).backward(seed)
    ev = g.first
    assert (ev.phase, ev.origin, ev.op, ev.kind) == ("backward", "producer", "mul", "inf"), ev.describe()


def test_a_routing_node_that_makes_the_output_is_still_hooked():
    # Nothing watched consumes the residual add's output, so its incoming gradient (a NaN passed to
    # backward) is measured at the add itself: the event says the gradient came in bad.
    net = nn.Sequential(nn.Linear(3, 3))
    net.forward = lambda x: net[0](x) + x  # the root module's own output is the add's
    seed = torch.full((2, 3), float("nan"))  # made before the block: the guard would name full_like
    with nan_guard(net, "record") as g:
        net(torch.ones(2, 3)).backward(seed)
    ev = g.first
    assert (ev.phase, ev.origin, ev.op) == ("backward", "input", "add"), ev.describe()
    assert ev.node == "AddBackward0"


def test_a_broadcasting_add_stays_hooked_its_gradient_sum_can_overflow():
    class Bias16(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Parameter(torch.zeros(2, dtype=torch.float16))

        def forward(self, x):
            return (x + self.b) * 100.0  # b's gradient: 4096 rows of 100 summed, past fp16's max

    net = Bias16()
    with nan_guard(net, "record") as g:
        net(torch.zeros(4096, 2, dtype=torch.float16)).float().sum().backward()
    ev = g.first
    assert (ev.phase, ev.origin, ev.op, ev.kind) == ("backward", "producer", "add", "inf"), ev.describe()
    assert ev.node == "AddBackward0"


def test_a_16_bit_linear_making_nan_from_finite_inputs_is_named_an_overflow():
    # found by a probe (T5's feed-forward, weights x 1e5): the cause read "unknown, inspect the op"; an fp16
    # product past 65504 of each sign summed to inf - inf = NaN
    net = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1e5, -1e5]]))
    with nan_guard(net, "record") as g, torch.autocast("cpu", torch.float16):
        net(torch.ones(1, 2))
    ev = g.first
    assert (ev.op, ev.kind, ev.cause.code) == ("linear", "nan", "matmul-overflow")
    assert "inf - inf" in ev.cause.text and "bf16 has fp32's range" in ev.cause.fix
