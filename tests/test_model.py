"""OrderBookNet: shapes, exact mask semantics, left-padding invariance, seeded init."""

from __future__ import annotations

import pytest
import torch

from quantloop.models.orderbook import ModelConfig, OrderBookNet

B, T, F_IN, OUT = 6, 12, 5, 3


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> OrderBookNet:
    torch.manual_seed(seed)
    return OrderBookNet(ModelConfig(n_features=F_IN, n_outputs=OUT)).to(dtype).eval()


def padded_batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 2, 5, 8, 12, 12])  # right-aligned windows, left padding
    mask = torch.arange(T)[None, :] >= (T - lengths)[:, None]  # [B, T]
    x = torch.randn(B, T, F_IN, generator=g, dtype=dtype)
    return x, mask


def left_pad(x: torch.Tensor, mask: torch.Tensor, extra: int, fill: float):
    pad = torch.full((x.shape[0], extra, x.shape[2]), fill, dtype=x.dtype)
    return torch.cat([pad, x], 1), torch.cat(
        [torch.zeros(x.shape[0], extra, dtype=torch.bool), mask], 1
    )


def test_shapes_and_no_mask_means_all_real():
    model = make_model()
    x, _ = padded_batch()
    with torch.no_grad():
        y = model(x)
        assert y.shape == (B, OUT)
        assert torch.equal(y, model(x, torch.ones(B, T, dtype=torch.bool)))


def test_padded_values_have_no_effect_bitwise():
    model = make_model()
    x, mask = padded_batch()
    garbage = torch.where(mask[..., None], x, torch.full_like(x, float("nan")))
    huge = torch.where(mask[..., None], x, torch.full_like(x, 1e6))
    with torch.no_grad():
        y = model(x, mask)
        assert torch.isfinite(y).all()
        assert torch.equal(model(garbage, mask), y)
        assert torch.equal(model(huge, mask), y)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_extra_left_padding_does_not_change_outputs(dtype, atol):
    # only summation order over a longer key axis differs: equal to rounding
    model = make_model(dtype=dtype)
    x, mask = padded_batch(dtype)
    with torch.no_grad():
        y = model(x, mask)
        for extra in (1, 7, 20):
            x2, m2 = left_pad(x, mask, extra, float("nan"))
            torch.testing.assert_close(model(x2, m2), y, atol=atol, rtol=0)
        # and each window alone, unpadded, gives the same as inside the padded batch
        alone = torch.cat([model(x[i : i + 1][:, mask[i]]) for i in range(B)])
    torch.testing.assert_close(alone, y, atol=atol, rtol=0)


def test_no_gradient_reaches_padding():
    model = make_model()
    x, mask = padded_batch()
    x.requires_grad_(True)
    model(x, mask).sum().backward()
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    assert x.grad[mask].abs().sum() > 0


def test_init_is_deterministic_per_seed():
    a, b, c = make_model(0).state_dict(), make_model(0).state_dict(), make_model(1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_window_longer_than_max_len_is_refused():
    torch.manual_seed(0)
    model = OrderBookNet(ModelConfig(n_features=2, n_outputs=1, max_len=4))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 5, 2))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"n_layers": 0}, "n_layers"),
        ({"dropout": 1.0}, "dropout"),
        ({"n_features": 0}, "n_features"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    base = {"n_features": 3, "n_outputs": 1}
    with pytest.raises(ValueError, match=field):
        ModelConfig(**(base | kwargs))
