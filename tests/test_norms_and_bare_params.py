"""The fp32 rules on models as people write them: norm classes of their own (Hugging Face's
LlamaRMSNorm, T5LayerNorm, timm's LayerNorm2d), and bare parameters added to activations (a ViT's
cls_token and pos_embed). With both recognised, bf16-true computes exactly what bf16-mixed does."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.islands import is_norm, island_names
from mixprec.masters.rules import DEFAULT_FP32_PARAMS, fp32_param_names


class LlamaRMSNorm(nn.Module):  # as transformers writes it: a plain nn.Module
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class T5LayerNorm(LlamaRMSNorm):
    pass


class LayerNorm2d(nn.LayerNorm):  # timm: a subclass, channels first
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class AdaLayerNorm(nn.Module):  # a "norm" with a projection: not a norm for the fp32 rules
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.proj = nn.Linear(d, 2 * d)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm1 = LlamaRMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.SiLU(), nn.Linear(4 * d, d, bias=False))
        self.norm = LlamaRMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(self.norm1(h))
        return self.head(self.norm(h))


class TinyViT(nn.Module):
    def __init__(self, d: int = 16, patches: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Linear(12, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, d) * 0.02)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x):  # x: (B, patches, 12)
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1).to(h.dtype), h], dim=1) + self.pos_embed
        h = h + self.block(h)
        return self.head(h[:, 0])


@pytest.mark.parametrize("module, expected", [
    (nn.LayerNorm(4), True), (nn.BatchNorm2d(4), True), (nn.GroupNorm(2, 4), True),
    (LlamaRMSNorm(4), True), (T5LayerNorm(4), True), (LayerNorm2d(4), True),
    (AdaLayerNorm(4), False), (nn.Linear(4, 4), False), (nn.Embedding(4, 4), False),
])
def test_the_norms_rule_knows_norm_classes_by_type_and_by_name(module, expected):
    assert is_norm(module) is expected


def test_a_hand_written_rmsnorm_is_an_fp32_island_and_describe_names_it():
    mp = MixedPrecision("bf16-mixed", "cpu")
    model = mp.prepare(TinyLlama())
    assert island_names(model) == ["norm1", "norm"]
    assert "norms (LlamaRMSNorm x2)" in mp.describe()
    with mp.autocast():
        assert model.norm(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16  # computed in fp32


def test_bare_parameters_and_custom_norm_weights_stay_fp32_under_storage_recipes():
    assert set(fp32_param_names(TinyViT(), DEFAULT_FP32_PARAMS)) >= {"cls_token", "pos_embed"}
    mp = MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(TinyLlama())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["norm1.weight"] == dtypes["norm.weight"] == torch.float32
    assert dtypes["mlp.0.weight"] == torch.bfloat16
    assert "norms (2)" in mp.describe() and "bare (2)" in mp.describe()


def _batches(kind: str, step: int):
    g = torch.Generator().manual_seed(step)
    if kind == "llama":
        ids = torch.randint(0, 32, (4, 8), generator=g)
        return ids, ids.roll(-1, 1)
    return torch.randn(4, 4, 12, generator=g), torch.randint(0, 5, (4,), generator=g)


@pytest.mark.parametrize("kind", ["llama", "vit"])
def test_bf16_true_trains_bitwise_like_bf16_mixed_on_models_people_write(kind):
    runs = {}
    for recipe in ("bf16-mixed", "bf16-true"):
        torch.manual_seed(0)
        model = TinyLlama() if kind == "llama" else TinyViT()
        mp = MixedPrecision(recipe, "cpu")
        model = mp.prepare(model)
        opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3)
        losses = []
        for step in range(4):
            x, y = _batches(kind, step)
            with mp.autocast():
                out = model(x)
            loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            losses.append(float(mp.step(loss, opt, max_grad_norm=1.0).loss))
        masters = mp.masters.masters() if mp.masters else {}
        runs[recipe] = (losses, {n: masters.get(n, p).detach() for n, p in model.named_parameters()})
    assert runs["bf16-mixed"][0] == runs["bf16-true"][0]
    for name, value in runs["bf16-mixed"][1].items():
        assert torch.equal(value, runs["bf16-true"][1][name]), name


def test_a_model_with_norm_like_modules_the_rule_does_not_know_gets_a_warning():
    class Standardize(nn.Module):  # a normalisation by another name
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.bias = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return (x - x.mean(-1, keepdim=True)) * self.weight + self.bias

    with pytest.warns(UserWarning, match=r"look like norms: 1 \(Standardize\).*fp32_modules=\['Standardize'\]"):
        MixedPrecision("bf16-mixed", "cpu").prepare(nn.Sequential(nn.Linear(4, 4), Standardize()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model whose norms the rule knows: no warning
        MixedPrecision("bf16-mixed", "cpu").prepare(TinyLlama())
