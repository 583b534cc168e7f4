"""The five master-weight strategies, ``STRATEGIES`` by kind and ``make_masters``.

``Fp32Masters`` (an fp32 copy: the proxy is the master), ``KahanMasters`` (16-bit Kahan
compensation), ``StochasticRoundingMasters`` (unbiased rounding to bf16, seeded generators kept in
the state), ``RemainderMasters`` (bf16 + an int16 remainder = an exact fp32 master) and the unsafe
baseline ``NearestMasters``. Each overrides the per-strategy hooks of ``MasterWeights``
(``mixprec.masters.base``) on flat buckets (``mixprec.masters.buckets``), with the arithmetic of
``mixprec.masters.rounding``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mixprec.masters.base import MasterWeights
from mixprec.masters.buckets import _Bucket, _flat, _flat_buffer, _Slot
from mixprec.masters.rounding import draw_key, join_fp32, kahan_add_, random_bits16, round_bf16_with_bits, split_fp32
from mixprec.masters.rules import ParamRule


class Fp32Masters(MasterWeights):
    """An fp32 master copy per 16-bit parameter (Apex O2, Megatron): the proxy *is* the master."""

    kind = "fp32"
    kept_bytes = 4  # per bucket element kept between steps (MIXPREC_MASTER_WORKSPACE): fp32 grads
    extra_bytes = 4
    value_bytes = 0  # the masters are the values: nothing to rebuild, the step runs whole
    temp_bytes = 2  # the flat 16-bit gradients of a bucket, while they become fp32
    description = "fp32 master copy, cast back to the model after each step"

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        for s, v in zip(b.slots, values_32):
            s.proxy.data = v
            s.param.copy_(v)

    def _materialize_bucket(self, b: _Bucket) -> None:
        pass  # the masters are the proxies' values already

    def _write_back_bucket(self, b: _Bucket) -> None:
        # round to nearest even, as torch casts; one foreach copy, no flat temporaries
        torch._foreach_copy_([s.param.data for s in b.slots], [s.proxy.data for s in b.slots])

    def _release_bucket(self, b: _Bucket) -> None:
        pass

    def master_value(self, slot: _Slot) -> torch.Tensor:
        return slot.proxy.data

    def extra_tensors(self, slot: _Slot) -> list[torch.Tensor]:
        return [slot.proxy.data]

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"master": slot.proxy.detach()}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        slot.proxy.data.copy_(state["master"])
        slot.param.copy_(slot.proxy.data)


class KahanMasters(MasterWeights):
    """No master: each update is added to the 16-bit weight with a 16-bit Kahan compensation."""

    kind = "kahan"
    kept_bytes = 10  # per bucket element kept between steps (MIXPREC_MASTER_WORKSPACE): fp32 grads, values, 16-bit weights
    uses_kernels = True
    extra_bytes = 2
    temp_bytes = 22  # the compensated addition in fp32
    description = "16-bit weights updated with a 16-bit Kahan compensation buffer"

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        super()._init_bucket(b, values_32)
        _flat_buffer(b, "comp", torch.zeros(b.numel, dtype=self.storage_dtype, device=b.device))

    def _materialize_flat(self, b: _Bucket) -> torch.Tensor:
        b.params_16 = self._flat_params(b)  # kept for the write-back: the parameters do not change in between
        return self._ws.flat("value32", [b.params_16], torch.float32)

    def _write_back_bucket(self, b: _Bucket) -> None:
        p_16 = self._flat_params(b)
        if self.kernels.compile:  # one fused pass (mixprec.masters.kernels), bit for bit the lines below
            p_16 = self.kernels("kahan", p_16, b.extra["comp"], self._stepped_values(b))
        else:
            # the update, stepped - p: as -p + stepped (the same bits) on p made fp32 first, which is
            # 3-5x faster on a CPU than one mixed-dtype op, in the same one new fp32 buffer
            kahan_add_(p_16, b.extra["comp"], p_16.float().neg_().add_(self._stepped_values(b)))
        self._store_params(b, p_16)

    def master_value(self, slot: _Slot) -> torch.Tensor:
        # The compensation holds the negated rounding error: the running sum is param - comp.
        return slot.param.to(torch.float32) - slot.extra["comp"].to(torch.float32)

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"param": slot.param.detach(), "comp": slot.extra["comp"]}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        slot.param.copy_(state["param"])
        slot.extra["comp"].copy_(state["comp"])


class StochasticRoundingMasters(MasterWeights):
    """No master: the stepped fp32 value is rounded to bf16 stochastically (unbiased).

    Args:
        seed: seeds one generator per device; ``None`` uses ``torch.initial_seed()`` at attach, so
            runs seeded with ``torch.manual_seed`` differ and repeat. The generator state is saved.
    """

    kind = "sr"
    kept_bytes = 8  # per bucket element kept between steps (MIXPREC_MASTER_WORKSPACE): fp32 grads, values
    uses_kernels = True
    extra_bytes = 0
    draws_on_write = True
    temp_bytes = 11  # the random bits, the finiteness test and the rounded result
    description = "bf16 weights, stepped in fp32 and stochastically rounded back (unbiased)"

    def __init__(self, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule], seed: int | None = None) -> None:
        super().__init__(storage_dtype, fp32_params)
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}
        # One key per step and device, drawn at its first write-back; each element's random bits
        # come from its place in the device's stream of elements, so buckets cut it anywhere.
        self._keys: dict[str, torch.Tensor] = {}
        self._key_bufs: dict[str, torch.Tensor] = {}  # (drawn into in place: a step allocates nothing for them)
        self._starts: dict[int, tuple[int, torch.Tensor]] = {}  # id(bucket) -> its first element in the stream

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self.generators.get(key)
        if g is None:
            seed = self.seed if self.seed is not None else torch.initial_seed()
            g = self.generators[key] = torch.Generator(device=device)
            g.manual_seed(seed % 2**63)
        return g

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        super()._init_bucket(b, values_32)  # the starting point is rounded to nearest: no noise before training
        self._generator(b.device)
        if id(b) not in self._starts:  # where each bucket starts in its device's stream, and the key buffers
            seen: dict[str, int] = {}
            for bb in self.buckets:
                at = seen.get(str(bb.device), 0)
                self._starts[id(bb)] = (at, torch.tensor(at, dtype=torch.int64, device=bb.device))
                seen[str(bb.device)] = at + bb.numel
                if str(bb.device) not in self._key_bufs:
                    self._key_bufs[str(bb.device)] = torch.zeros(2, dtype=torch.int64, device=bb.device)

    def _write_back_bucket(self, b: _Bucket) -> None:
        stepped = self._stepped_values(b)
        key = self._keys.get(str(b.device))
        if key is None:
            key = self._keys[str(b.device)] = draw_key(self._generator(b.device), b.device, out=self._key_bufs[str(b.device)])
        start, start_t = self._starts[id(b)]
        if self.kernels.compile:  # one fused pass (mixprec.masters.kernels): the same bits
            self._store_params(b, self.kernels("sr", stepped, key, start_t))
        else:
            self._store_params(b, round_bf16_with_bits(stepped, random_bits16(stepped.numel(), key, start)))

    def after_step(self) -> None:
        super().after_step()
        self._keys = {}  # the next step draws new ones

    def abort_step(self) -> None:
        super().abort_step()
        self._keys = {}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["generators"] = {k: g.get_state() for k, g in self.generators.items()}
        return state

    def check_state_dict(self, state: Any) -> None:
        super().check_state_dict(state)
        gens = state.get("generators", {})
        if not isinstance(gens, dict):
            raise ValueError(f"master-weight state's 'generators' must be a dict of device -> generator state, got "
                             f"{type(gens).__name__}: the checkpoint is damaged or was edited")
        for key, gen_state in gens.items():
            try:  # on a scratch generator: what set_state would refuse, refused before anything is written
                torch.Generator(device=torch.device(key)).set_state(gen_state)
            except (RuntimeError, TypeError, ValueError) as e:
                raise ValueError(f"master-weight state's random generator for device {key!r} cannot be restored "
                                 f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): the checkpoint is "
                                 "damaged or was saved on another kind of device") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # (checks the generators too, before writing anything)
        for key, gen_state in state.get("generators", {}).items():
            self._generator(torch.device(key)).set_state(gen_state)


class RemainderMasters(MasterWeights):
    """An exact fp32 master kept as the bf16 weight plus an int16 remainder (Megatron's trick).

    The model's weight is the master rounded to nearest with ties away from zero (it differs
    from torch's ties-to-even cast only on exact ties): that is what lets 16 extra bits hold
    the rest of the master exactly.
    """

    kind = "remainder"
    kept_bytes = 6  # per bucket element kept between steps (MIXPREC_MASTER_WORKSPACE): fp32 grads, 16-bit weights
    uses_kernels = True
    extra_bytes = 2
    temp_bytes = 11  # joining and splitting bit patterns
    description = "bf16 weights + int16 remainders = an exact fp32 master"

    def _init_bucket(self, b: _Bucket, values_32: list[torch.Tensor]) -> None:
        high, rem = split_fp32(_flat(values_32))
        self._store_params(b, high)
        _flat_buffer(b, "rem", rem)

    def _materialize_flat(self, b: _Bucket) -> torch.Tensor:
        return self.kernels("join", self._flat_params(b), b.extra["rem"])

    def _write_back_bucket(self, b: _Bucket) -> None:
        self._store_params(b, self.kernels("split", self._stepped_values(b), b.extra["rem"]))

    def master_value(self, slot: _Slot) -> torch.Tensor:
        return join_fp32(slot.param.data, slot.extra["rem"])

    def _slot_state(self, slot: _Slot) -> dict[str, torch.Tensor]:
        return {"master": self.master_value(slot)}

    def _load_slot_state(self, slot: _Slot, state: dict[str, torch.Tensor]) -> None:
        high, rem = split_fp32(state["master"].to(device=slot.param.device, dtype=torch.float32))
        slot.param.copy_(high)
        slot.extra["rem"].copy_(rem)


class NearestMasters(MasterWeights):
    """No master and no compensation: round to nearest after each step. UNSAFE, a baseline.

    The optimizer still steps in fp32 with fp32 state; only the weight is rounded. Any update
    smaller than half a 16-bit ulp of its weight (relative 2**-9 for bf16) is lost entirely.
    """

    kind = "nearest"
    kept_bytes = 8  # per bucket element kept between steps (MIXPREC_MASTER_WORKSPACE): fp32 grads, values
    extra_bytes = 0
    description = "16-bit weights rounded to nearest after each step, no master (small updates vanish)"

    def _write_back_bucket(self, b: _Bucket) -> None:
        self._store_params(b, self._stepped_values(b))  # the copy rounds to nearest even


STRATEGIES: dict[str, type[MasterWeights]] = {
    cls.kind: cls for cls in (Fp32Masters, KahanMasters, StochasticRoundingMasters, RemainderMasters, NearestMasters)
}


def make_masters(kind: str, storage_dtype: torch.dtype, fp32_params: Sequence[ParamRule]) -> MasterWeights:
    """The strategy a recipe names (``Recipe.master``)."""
    cls = STRATEGIES.get(kind)
    if cls is None:
        raise ValueError(f"unknown master-weight strategy {kind!r}; expected one of {sorted(STRATEGIES)}")
    return cls(storage_dtype, fp32_params)
