"""Modified Bessel functions of orders 0 and 1 (``i0``, ``i0e``, ``i1``, ``i1e``, and
``special``'s ``modified_bessel_*`` and ``scaled_modified_bessel_k*``), which have no ONNX
operator: Cephes' Chebyshev expansions, as eager's kernels evaluate them (Clenshaw's
recurrence, the same two intervals and coefficients), in double for float32 inputs too -
eager's float32 kernels use shorter tables, so the result here is the closer one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qaic_dynamo.lowering.semantics.common import is_float_tensor

__all__ = ["BESSEL"]

# Cephes' coefficients, as torch's ATen/native/Math.h lists them: I0 and I1 scaled by
# exp(-x) on [0, 8] (in x/2 - 2) and (8, inf) (in 32/x - 2); K0 and K1 on (0, 2] (in
# x^2 - 2, with the log term apart) and (2, inf) (in 8/x - 2, scaled by exp(x)).
_I0_SMALL = (
    -4.4153416464793395e-18,
    3.3307945188222384e-17,
    -2.431279846547955e-16,
    1.715391285555133e-15,
    -1.1685332877993451e-14,
    7.676185498604936e-14,
    -4.856446783111929e-13,
    2.95505266312964e-12,
    -1.726826291441556e-11,
    9.675809035373237e-11,
    -5.189795601635263e-10,
    2.6598237246823866e-09,
    -1.300025009986248e-08,
    6.046995022541919e-08,
    -2.670793853940612e-07,
    1.1173875391201037e-06,
    -4.4167383584587505e-06,
    1.6448448070728896e-05,
    -5.754195010082104e-05,
    0.00018850288509584165,
    -0.0005763755745385824,
    0.0016394756169413357,
    -0.004324309995050576,
    0.010546460394594998,
    -0.02373741480589947,
    0.04930528423967071,
    -0.09490109704804764,
    0.17162090152220877,
    -0.3046826723431984,
    0.6767952744094761,
)
_I0_LARGE = (
    -7.233180487874754e-18,
    -4.830504485944182e-18,
    4.46562142029676e-17,
    3.461222867697461e-17,
    -2.8276239805165836e-16,
    -3.425485619677219e-16,
    1.7725601330565263e-15,
    3.8116806693526224e-15,
    -9.554846698828307e-15,
    -4.150569347287222e-14,
    1.54008621752141e-14,
    3.8527783827421426e-13,
    7.180124451383666e-13,
    -1.7941785315068062e-12,
    -1.3215811840447713e-11,
    -3.1499165279632416e-11,
    1.1889147107846439e-11,
    4.94060238822497e-10,
    3.3962320257083865e-09,
    2.266668990498178e-08,
    2.0489185894690638e-07,
    2.8913705208347567e-06,
    6.889758346916825e-05,
    0.0033691164782556943,
    0.8044904110141088,
)
_I1_SMALL = (
    2.7779141127610464e-18,
    -2.111421214358166e-17,
    1.5536319577362005e-16,
    -1.1055969477353862e-15,
    7.600684294735408e-15,
    -5.042185504727912e-14,
    3.223793365945575e-13,
    -1.9839743977649436e-12,
    1.1736186298890901e-11,
    -6.663489723502027e-11,
    3.625590281552117e-10,
    -1.8872497517228294e-09,
    9.381537386495773e-09,
    -4.445059128796328e-08,
    2.0032947535521353e-07,
    -8.568720264695455e-07,
    3.4702513081376785e-06,
    -1.3273163656039436e-05,
    4.781565107550054e-05,
    -0.00016176081582589674,
    0.0005122859561685758,
    -0.0015135724506312532,
    0.004156422944312888,
    -0.010564084894626197,
    0.024726449030626516,
    -0.05294598120809499,
    0.1026436586898471,
    -0.17641651835783406,
    0.25258718644363365,
)
_I1_LARGE = (
    7.517296310842105e-18,
    4.414348323071708e-18,
    -4.6503053684893586e-17,
    -3.209525921993424e-17,
    2.96262899764595e-16,
    3.3082023109209285e-16,
    -1.8803547755107825e-15,
    -3.8144030724370075e-15,
    1.0420276984128802e-14,
    4.272440016711951e-14,
    -2.1015418427726643e-14,
    -4.0835511110921974e-13,
    -7.198551776245908e-13,
    2.0356285441470896e-12,
    1.4125807436613782e-11,
    3.2526035830154884e-11,
    -1.8974958123505413e-11,
    -5.589743462196584e-10,
    -3.835380385964237e-09,
    -2.6314688468895196e-08,
    -2.512236237870209e-07,
    -3.882564808877691e-06,
    -0.00011058893876262371,
    -0.009761097491361469,
    0.7785762350182801,
)
_K0_SMALL = (
    1.374465435613523e-16,
    4.25981614279661e-14,
    1.0349695257633842e-11,
    1.904516377220209e-09,
    2.5347910790261494e-07,
    2.286212103119452e-05,
    0.001264615411446926,
    0.0359799365153615,
    0.3442898999246285,
    -0.5353273932339028,
)
_K0_LARGE = (
    5.300433772686263e-18,
    -1.6475804301524212e-17,
    5.2103915050390274e-17,
    -1.678231096805412e-16,
    5.512055978524319e-16,
    -1.848593377343779e-15,
    6.3400764774050706e-15,
    -2.2275133269916698e-14,
    8.032890775363575e-14,
    -2.9800969231727303e-13,
    1.140340588208475e-12,
    -4.514597883373944e-12,
    1.8559491149547177e-11,
    -7.957489244477107e-11,
    3.577397281400301e-10,
    -1.69753450938906e-09,
    8.574034017414225e-09,
    -4.660489897687948e-08,
    2.766813639445015e-07,
    -1.8317555227191195e-06,
    1.39498137188765e-05,
    -0.00012849549581627802,
    0.0015698838857300533,
    -0.0314481013119645,
    2.4403030820659555,
)
_K1_SMALL = (
    -7.023863479386288e-18,
    -2.427449850519366e-15,
    -6.666901694199329e-13,
    -1.4114883926335278e-10,
    -2.213387630734726e-08,
    -2.4334061415659684e-06,
    -0.0001730288957513052,
    -0.006975723859639864,
    -0.12261118082265715,
    -0.3531559607765449,
    1.5253002273389478,
)
_K1_LARGE = (
    -5.756744483665017e-18,
    1.7940508731475592e-17,
    -5.689462558442859e-17,
    1.838093544366639e-16,
    -6.057047248373319e-16,
    2.038703165624334e-15,
    -7.019837090418314e-15,
    2.4771544244813043e-14,
    -8.976705182324994e-14,
    3.3484196660784293e-13,
    -1.2891739609510289e-12,
    5.13963967348173e-12,
    -2.1299678384275683e-11,
    9.218315187605006e-11,
    -4.1903547593418965e-10,
    2.015049755197033e-09,
    -1.0345762465678097e-08,
    5.7410841254500495e-08,
    -3.5019606030878126e-07,
    2.406484947837217e-06,
    -1.936197974166083e-05,
    0.00019521551847135162,
    -0.002857816859622779,
    0.10392373657681724,
    2.7206261904844427,
)


def _chbevl(y: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    b0 = torch.full_like(y, coefficients[0])
    b1 = torch.zeros_like(y)
    b2 = torch.zeros_like(y)
    for c in coefficients[1:]:
        b2, b1 = b1, b0
        b0 = y * b1 - b2 + c
    return 0.5 * (b0 - b2)


def _i0e(a: torch.Tensor) -> torch.Tensor:
    """exp(-|x|) I0(x) for ``a = |x|``."""
    small = _chbevl(a / 2 - 2, _I0_SMALL)
    large = _chbevl(32 / torch.where(a > 8, a, 32.0) - 2, _I0_LARGE) / torch.sqrt(a)
    return torch.where(a <= 8, small, large)


def _i1e(a: torch.Tensor) -> torch.Tensor:
    """exp(-|x|) I1(|x|) for ``a = |x|``."""
    small = _chbevl(a / 2 - 2, _I1_SMALL) * a
    large = _chbevl(32 / torch.where(a > 8, a, 32.0) - 2, _I1_LARGE) / torch.sqrt(a)
    return torch.where(a <= 8, small, large)


def _k(x: torch.Tensor, order: int, scaled: bool) -> torch.Tensor:
    """K0 / K1 (times exp(x) if ``scaled``): inf at 0, NaN below."""
    near = torch.where(x <= 2, x, 1.0)
    log_half = torch.log(0.5 * near)
    if order == 0:
        small = _chbevl(near * near - 2, _K0_SMALL) - log_half * torch.exp(near) * _i0e(near)
    else:
        small = log_half * torch.exp(near) * _i1e(near) + _chbevl(near * near - 2, _K1_SMALL) / near
    far = torch.where(x > 2, x, 4.0)
    large = _chbevl(8 / far - 2, _K0_LARGE if order == 0 else _K1_LARGE) / torch.sqrt(far)
    out = torch.where(x <= 2, small * torch.exp(near) if scaled else small, large if scaled else torch.exp(-x) * large)
    out = torch.where(x == 0, math.inf, out)
    return torch.where((x < 0) | torch.isnan(x), math.nan, out)


def _double(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def run(x: Any) -> Any:
        if not is_float_tensor(x):
            return NotImplemented
        return fn(x.double()).to(x.dtype)

    return run


def _signed(x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    return torch.where(x < 0, -magnitude, magnitude)


_i0 = _double(lambda x: torch.exp(x.abs()) * _i0e(x.abs()))
_i0e_op = _double(lambda x: _i0e(x.abs()))
_i1 = _double(lambda x: _signed(x, torch.exp(x.abs()) * _i1e(x.abs())))
_i1e_op = _double(lambda x: _signed(x, _i1e(x.abs())))

_aten, _prims = torch.ops.aten, torch.ops.prims
#: aten / prims op -> its evaluation.
BESSEL: dict[Any, Callable[..., Any]] = {
    _prims.bessel_i0.default: _i0,
    _aten.i0.default: _i0,
    _aten.special_modified_bessel_i0.default: _i0,
    _prims.bessel_i0e.default: _i0e_op,
    _aten.special_i0e.default: _i0e_op,
    _prims.bessel_i1.default: _i1,
    _aten.special_i1.default: _i1,
    _aten.special_modified_bessel_i1.default: _i1,
    _prims.bessel_i1e.default: _i1e_op,
    _aten.special_i1e.default: _i1e_op,
    _aten.special_modified_bessel_k0.default: _double(lambda x: _k(x, 0, scaled=False)),
    _aten.special_modified_bessel_k1.default: _double(lambda x: _k(x, 1, scaled=False)),
    _aten.special_scaled_modified_bessel_k0.default: _double(lambda x: _k(x, 0, scaled=True)),
    _aten.special_scaled_modified_bessel_k1.default: _double(lambda x: _k(x, 1, scaled=True)),
}
