"""Gradient folding: the 16-bit gradients of a backward become the fp32 gradients of the masters.

Holds ``_GradFolding``, the ``MasterWeights`` mixin with ``after_backward`` (fold, or at an
optimizer boundary decide whether the step runs in buckets and whether the 16-bit gradients stay
deferred on the model until their bucket steps), ``_fold_grads`` / ``_fold_bucket_grads`` (the
folding itself, unscaled and clipped as the whole step would), and what serves the loss scaler
and the clip while gradients are deferred: ``pending_grad``, ``pending_grads``,
``set_grad_unscale`` and ``deferred_grad_norm_``.

Relies on ``mixprec.masters.buckets`` (``_views``) and on the state
``MasterWeights.__init__`` (``mixprec.masters.base``) sets: ``slots``, ``buckets``, ``_by_proxy``,
``stepping``, ``in_buckets``, ``deferred``, ``_grad_coef``, ``_clipped``, ``_grad_unscale``,
``_unscaled``, ``_unscale_exact``, ``_ws`` (a ``buckets._Workspace``); and on its methods ``check_frozen``, ``check_optimizers``,
``can_step_in_buckets`` and ``_materialize_bucket``, and the class attribute ``value_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec.masters.buckets import _Bucket, _Slot, _views


class _GradFolding:
    """16-bit gradients -> fp32 master gradients, and the deferred ones (see the module docstring)."""

    def after_backward(self, optimizers: Sequence[torch.optim.Optimizer], boundary: bool,
                       defer: bool = False) -> None:
        """Fold 16-bit gradients into fp32 proxy gradients; at a boundary, materialise the proxies.

        With ``defer`` (nothing reads the gradients before the step but the loss scaler's inf
        check and the clip, which ``pending_grads``/``deferred_grad_norm_`` serve from the 16-bit
        ones, unscaled by ``set_grad_unscale`` when the scaler has a scale), a boundary
        that starts a bucketed step with no fp32 gradient accumulated yet folds nothing: each
        bucket's gradients become fp32 in its own step, so the step never holds fp32 gradients
        for the whole model.
        """
        self.check_frozen()
        if boundary:
            self.check_optimizers(optimizers)
            in_parts = self.can_step_in_buckets(optimizers)
            self.deferred = defer and in_parts and all(
                s.proxy.grad is None and (s.param.grad is None or s.param.grad.layout == torch.strided)
                for s in self.slots
            )
            # fp32 masters rebuild nothing: stepping them in parts pays only for deferred gradients
            self.in_buckets = in_parts and (self.value_bytes > 0 or self.deferred)
            self._grad_coef, self._clipped, self._grad_unscale, self._unscaled = None, set(), None, set()
            if self.deferred:
                self.stepping = True
                return
        with torch.no_grad():
            for b in self.buckets:
                self._fold_grads(b.slots)
            if boundary:
                if not self.in_buckets:
                    for b in self.buckets:
                        self._materialize_bucket(b)
                self.stepping = True

    def _fold_grads(self, slots: Sequence[_Slot], coef: torch.Tensor | None = None,
                    clipped: set[int] | frozenset[int] = frozenset(), unscale: torch.Tensor | None = None) -> None:
        """Move the 16-bit gradients of ``slots`` (one bucket's) into fp32 proxy gradients, times
        ``unscale`` (a loss scaler's inverse scale) and then, those of the slots in ``clipped``
        (ids), times ``coef`` (a clip coefficient): the products the scaler's unscale and the clip
        make on fp32 gradients, in their order. Accumulation across micro-steps adds in fp32."""
        fresh, dense_fresh, accum = [], [], []
        for s in slots:
            g = s.param.grad
            if g is None:
                continue
            if s.proxy.grad is not None:
                accum.append(s)  # accumulation across micro-steps happens in fp32
            elif g.is_sparse or g.layout != torch.strided:
                fresh.append(s)
            else:
                dense_fresh.append(s)
        if dense_fresh:
            # one flat fp32 gradient per bucket; each proxy's .grad is a view of it
            flat = self._ws.flat("grad32", [s.param.grad for s in dense_fresh], torch.float32)
            if unscale is not None:
                flat.mul_(unscale)
            views = _views(flat, [s.param for s in dense_fresh])
            if coef is not None:
                hit = [v for s, v in zip(dense_fresh, views) if id(s) in clipped]
                if len(hit) == len(views):
                    flat.mul_(coef)
                elif hit:
                    torch._foreach_mul_(hit, coef)  # the same multiplication, on the clipped ones only
            for s, g32 in zip(dense_fresh, views):
                s.proxy.grad = g32
        for s in fresh:
            s.proxy.grad = s.param.grad.to(torch.float32)
        if accum:
            torch._foreach_add_([s.proxy.grad for s in accum], [s.param.grad for s in accum])
        for s in (*dense_fresh, *fresh, *accum):
            s.param.grad = None

    def pending_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient an optimizer parameter will step with: a proxy's deferred 16-bit one, or its own."""
        slot = self._by_proxy.get(id(p)) if self.deferred and p.grad is None else None
        return slot.param.grad if slot is not None else p.grad

    def deferred_grad_norm_(self, params: Sequence[torch.Tensor], max_norm: float | None,
                            norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` (``get_total_norm`` when ``max_norm`` is None) over
        ``params`` (proxies and other parameters) while their 16-bit gradients are deferred: each
        16-bit gradient's norm is computed in fp32 without a copy (on CPU bitwise the norm of its
        fp32 value: tested), combined as torch combines them; fp32 gradients are scaled now,
        deferred ones when their bucket is folded (the same multiplication). Under a loss scaler
        (``set_grad_unscale``) a deferred gradient's norm is its scaled norm times the inverse
        scale when the scale is a power of two (bitwise the norm of the unscaled fp32 gradient),
        else the norm of its unscaled fp32 products, made one tensor at a time."""
        items: list[tuple[torch.Tensor, bool]] = []  # (gradient, still 16-bit on the model)
        deferred_slots: set[int] = set()
        for p in params:
            g = self.pending_grad(p)
            if g is not None:
                items.append((g, p.grad is None))
                if p.grad is None:  # a proxy whose 16-bit gradient waits (pending_grad found its slot)
                    deferred_slots.add(id(self._by_proxy[id(p)]))
        if not items:
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        first = items[0][0].device
        by_device: dict[torch.device, list[tuple[torch.Tensor, bool]]] = {}
        for g, is16 in items:
            by_device.setdefault(g.device, []).append((g, is16))
        norms: list[torch.Tensor] = []
        with torch.no_grad():
            for dev, group in by_device.items():
                got = torch._foreach_norm([g for g, _ in group], norm_type, dtype=torch.float32)
                if self._grad_unscale is not None:  # the deferred ones are still multiplied by the scale
                    # (only the optimizer's: the scaler unscales no other gradient, fp32 or deferred)
                    scaled = [i for i, (g, is16) in enumerate(group) if is16 and id(g) in self._unscaled]
                    inv = self._grad_unscale.to(dev)
                    if self._unscale_exact:  # x * 2**-k is exact: the scaled norm times 2**-k is the norm
                        if scaled:
                            torch._foreach_mul_([got[i] for i in scaled], inv)
                    else:
                        # Any other scale rounds each product g * inv, so the norm of the rounded
                        # products (what the whole step measures, after unscale_) is not the scaled
                        # norm times inv: measure those products, one fp32 temporary at a time.
                        got = list(got)
                        for i in scaled:
                            got[i] = torch._foreach_norm([group[i][0].to(torch.float32).mul_(inv)], norm_type)[0]
                norms.extend(got)
            total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
            if max_norm is not None:
                coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
                now: dict[torch.device, list[torch.Tensor]] = {}
                for g, is16 in items:
                    if not is16:
                        now.setdefault(g.device, []).append(g)
                for dev, grads in now.items():
                    torch._foreach_mul_(grads, coef.to(dev))
                self._grad_coef, self._clipped = coef, deferred_slots
        return total

    def pending_grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The deferred 16-bit gradients of ``optimizer``'s proxies (waiting on the model)."""
        if not self.deferred:
            return []
        out = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                slot = self._by_proxy.get(id(p)) if p.grad is None else None
                if slot is not None and slot.param.grad is not None:
                    out.append(slot.param.grad)
        return out

    def set_grad_unscale(self, inv_scale: torch.Tensor | None, pending: Sequence[torch.Tensor] = (),
                         exact: bool = True) -> None:
        """A loss scaler's inverse scale: deferred gradients are multiplied by it when folded
        (and the norms of ``pending``, the optimizer's ones the scaler checked, when measured), as
        ``unscale_`` multiplies the optimizer's fp32 gradients and no others. ``exact``: the scale
        is a power of two (``GradScaler.scale_is_power_of_two``), so a norm can be unscaled whole."""
        self._grad_unscale = inv_scale
        self._unscaled = {id(g) for g in pending}
        self._unscale_exact = bool(exact)

    def _fold_bucket_grads(self, b: _Bucket) -> None:
        """Fold a bucket's deferred 16-bit gradients, unscaled and clipped as this step asks."""
        coef = None if self._grad_coef is None else self._grad_coef.to(b.device)
        unscale = None if self._grad_unscale is None else self._grad_unscale.to(b.device)
        self._fold_grads(b.slots, coef, self._clipped, unscale)
