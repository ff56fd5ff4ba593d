"""Where onnxscript's translation differs from eager: torch's own semantics, as
decompositions applied in the aten trace (and before the exporter's own, on its fallback
path). One module per op family; :data:`TORCH_SEMANTICS` maps each aten op to the
decomposition that spells eager's result in ops whose translations are exact. A
decomposition returns ``NotImplemented`` where the translation is already right (a dtype
it leaves alone), and raises ``LoweringError`` where no translation can be (the piece
then runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo.lowering.semantics.adaptive_pooling import adaptive_avg_pool3d, adaptive_max_pool2d
from qaic_dynamo.lowering.semantics.attention import masked_attention, open_sdpa
from qaic_dynamo.lowering.semantics.bessel import BESSEL
from qaic_dynamo.lowering.semantics.complex_values import conj_physical, pad_complex
from qaic_dynamo.lowering.semantics.distances import cdist, hypot, pdist
from qaic_dynamo.lowering.semantics.division import div_mode, floor_divide, integer_rest, remainder
from qaic_dynamo.lowering.semantics.elementwise import atan2, expm1, integer_pow, log1p, nan_ignoring
from qaic_dynamo.lowering.semantics.empty import cat_of_empties, im2col_of_empty, pixel_unshuffle_of_empty
from qaic_dynamo.lowering.semantics.gamma import digamma, lgamma, polygamma, zeta
from qaic_dynamo.lowering.semantics.householder import geqrf, householder_product, ormqr, qr
from qaic_dynamo.lowering.semantics.indexing import (
    arange,
    index_add_in_float32,
    index_put_in_float32,
    index_reduce,
    scatter_reduce,
)
from qaic_dynamo.lowering.semantics.linear_algebra import addmm_maybe_empty_inner
from qaic_dynamo.lowering.semantics.lu import det, inv_ex, lu_factor_ex, lu_solve, lu_unpack, plu, slogdet, solve_ex
from qaic_dynamo.lowering.semantics.misc_ops import frexp, histc_of_data_range, nonzero_static
from qaic_dynamo.lowering.semantics.normalization import (
    batch_norm_no_training,
    batch_norm_training,
    batch_norm_with_update,
    layer_norm_in_float32,
)
from qaic_dynamo.lowering.semantics.order import median, median_dim, nanmedian, nanmedian_dim, sort_stable
from qaic_dynamo.lowering.semantics.polynomials import POLYNOMIALS
from qaic_dynamo.lowering.semantics.pooling import avg_pool_with_divisor
from qaic_dynamo.lowering.semantics.reduced_floats import (
    in_float32,
    in_place,
    reduced_float_comparison,
    reduced_float_scaled_sum,
    reduced_float_scaling,
)
from qaic_dynamo.lowering.semantics.reductions import (
    any_as_count,
    exact_integer_sum,
    float32_cumsum,
    float_prod_over_dims,
    integer_isclose,
    kthvalue_by_sort,
    mean_of_all_maybe_empty,
    mean_of_maybe_empty,
    reduce_all_dims,
    refuse_integer_prod,
    var_of_maybe_few,
)
from qaic_dynamo.lowering.semantics.refusals import refusal
from qaic_dynamo.lowering.semantics.resampling import antialiased_resize
from qaic_dynamo.lowering.semantics.scalar_reductions import (
    aminmax_of_scalar,
    first_of,
    identity_of_scalar,
    logical_all_of_scalar,
    norm_of_scalar,
    squeeze_sized,
    sum_of_scalar,
    topk_of_scalar,
)
from qaic_dynamo.lowering.semantics.scattering import diagonal_scatter, put, scatter_with_reduce
from qaic_dynamo.lowering.semantics.searching import bucketize, cumulative_extreme, searchsorted
from qaic_dynamo.lowering.semantics.special import erfc, erfcx, signbit
from qaic_dynamo.lowering.semantics.spectra import eigh, pinv, svd_values
from qaic_dynamo.lowering.semantics.spectral import fft_in_double
from qaic_dynamo.lowering.semantics.triangular import (
    cholesky,
    cholesky_ex,
    cholesky_inverse,
    cholesky_solve,
    solve_triangular,
    triangular_solve,
)

__all__ = ["TORCH_SEMANTICS", "open_sdpa"]

_aten = torch.ops.aten
#: Ops whose onnxscript translation disagrees with eager, decomposed in the aten trace.
TORCH_SEMANTICS: dict[Any, Callable[..., Any]] = {
    _aten.scatter_reduce.two: scatter_reduce,
    _aten.index_reduce.default: index_reduce,
    _aten.arange.default: arange,
    _aten.arange.start: arange,
    _aten.arange.start_step: arange,
    _aten.logsumexp.default: in_float32(_aten.logsumexp.default),
    _aten.log1p.default: log1p,
    _aten.native_layer_norm.default: layer_norm_in_float32,
    _aten.index_add.default: index_add_in_float32,
    _aten.index_put.default: index_put_in_float32,
    _aten.expm1.default: expm1,
    _aten.amax.default: first_of(identity_of_scalar, reduce_all_dims(_aten.amax.default)),
    _aten.amin.default: first_of(identity_of_scalar, reduce_all_dims(_aten.amin.default)),
    _aten.aminmax.default: aminmax_of_scalar,
    _aten.topk.default: topk_of_scalar,
    _aten.all.dim: logical_all_of_scalar,
    _aten.all.dims: logical_all_of_scalar,
    _aten.linalg_vector_norm.default: norm_of_scalar,
    **{
        op: squeeze_sized
        for op in (_aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze_copy.dim, _aten.squeeze_copy.dims)
    },
    torch.ops.prims.prod.default: float_prod_over_dims,
    _aten.kthvalue.default: kthvalue_by_sort,
    torch.ops.prims.fmax.default: nan_ignoring(largest=True),
    torch.ops.prims.fmin.default: nan_ignoring(largest=False),
    torch.ops.prims.signbit.default: lambda x: signbit(x) if x.is_floating_point() else x < 0,
    _aten.floor_divide.default: floor_divide,
    _aten.floor_divide.Scalar: floor_divide,
    _aten.remainder.Tensor: remainder,
    _aten.remainder.Scalar: remainder,
    _aten.remainder.Scalar_Tensor: remainder,
    _aten.div.Tensor_mode: div_mode,
    _aten.div.Scalar_mode: div_mode,
    _aten.atan2.default: atan2,
    _aten.fmod.Tensor: lambda a, b: integer_rest(a, b, "trunc"),
    _aten.fmod.Scalar: lambda a, b: integer_rest(a, b, "trunc"),
    _aten.any.default: any_as_count,
    _aten.any.dim: any_as_count,
    _aten.any.dims: any_as_count,
    _aten.pow.Tensor_Scalar: integer_pow,
    _aten.pow.Tensor_Tensor: integer_pow,
    _aten.pow.Scalar: integer_pow,
    _aten.isclose.default: integer_isclose,
    _aten.cumsum.default: float32_cumsum,
    _aten.mean.dim: first_of(identity_of_scalar, mean_of_maybe_empty),
    _aten.mean.default: mean_of_all_maybe_empty,
    torch.ops.prims.var.default: var_of_maybe_few,
    _aten.addmm.default: addmm_maybe_empty_inner,
    **{op: fft_in_double(op) for op in (_aten._fft_r2c.default, _aten._fft_c2c.default, _aten._fft_c2r.default)},
    # linear algebra, unrolled at the matrix's static size
    _aten.linalg_lu_factor_ex.default: lu_factor_ex,
    _aten.linalg_lu.default: plu,
    _aten.lu_unpack.default: lu_unpack,
    _aten.linalg_lu_solve.default: lu_solve,
    _aten._linalg_solve_ex.default: solve_ex,
    _aten.linalg_inv_ex.default: inv_ex,
    _aten._linalg_det.default: det,
    _aten._linalg_slogdet.default: slogdet,
    _aten.linalg_solve_triangular.default: solve_triangular,
    _aten.triangular_solve.default: triangular_solve,
    _aten.linalg_cholesky_ex.default: cholesky_ex,
    _aten.cholesky.default: cholesky,
    _aten.cholesky_solve.default: cholesky_solve,
    _aten.cholesky_inverse.default: cholesky_inverse,
    _aten.geqrf.default: geqrf,
    _aten.linalg_householder_product.default: householder_product,
    _aten.ormqr.default: ormqr,
    _aten.linalg_qr.default: qr,
    _aten._linalg_eigh.default: eigh,
    _aten._linalg_svd.default: svd_values,
    _aten.linalg_pinv.atol_rtol_tensor: pinv,
    **POLYNOMIALS,
    **BESSEL,
    torch.ops.prims.frexp.default: frexp,
    _aten.frexp.Tensor: frexp,
    _aten.nonzero_static.default: nonzero_static,
    _aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    _aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
    _aten.put.default: put,
    _aten.scatter.reduce: scatter_with_reduce,
    _aten.scatter.value_reduce: scatter_with_reduce,
    _aten.diagonal_scatter.default: diagonal_scatter,
    _aten.median.default: median,
    _aten.nanmedian.default: nanmedian,
    _aten.median.dim: median_dim,
    _aten.nanmedian.dim: nanmedian_dim,
    _aten.sort.stable: sort_stable,
    _aten.im2col.default: im2col_of_empty,
    _aten.pixel_unshuffle.default: pixel_unshuffle_of_empty,
    _aten.cat.default: cat_of_empties,
    torch.ops.prims.hypot.default: hypot,
    _aten.hypot.default: hypot,
    _aten._cdist_forward.default: cdist,
    _aten._pdist_forward.default: pdist,
    _aten.searchsorted.Tensor: searchsorted,
    _aten.searchsorted.Scalar: searchsorted,
    _aten.bucketize.Tensor: bucketize,
    _aten.bucketize.Scalar: bucketize,
    _aten.cummax.default: cumulative_extreme(largest=True),
    _aten.cummin.default: cumulative_extreme(largest=False),
    _aten.lgamma.default: lgamma,
    torch.ops.prims.lgamma.default: lgamma,
    _aten.digamma.default: digamma,
    torch.ops.prims.digamma.default: digamma,
    _aten.polygamma.default: polygamma,
    torch.ops.prims.zeta.default: zeta,
    _aten.special_zeta.default: zeta,
    _aten._conj_physical.default: conj_physical,
    _aten.conj_physical.default: conj_physical,
    _aten.constant_pad_nd.default: pad_complex,
    _aten.special_erfcx.default: erfcx,
    _aten.erfc.default: erfc,
    _aten.signbit.default: signbit,
    _aten._upsample_bilinear2d_aa.default: antialiased_resize(_aten._upsample_bilinear2d_aa.default),
    _aten._upsample_bicubic2d_aa.default: antialiased_resize(_aten._upsample_bicubic2d_aa.default),
    _aten.sum.default: exact_integer_sum,
    _aten.sum.dim_IntList: first_of(sum_of_scalar, exact_integer_sum),
    _aten.prod.default: refuse_integer_prod,
    _aten.prod.dim_int: first_of(sum_of_scalar, refuse_integer_prod),
    # onnxscript's translation (a Loop over a sequence) crashes ONNX Runtime's session
    # creation (a segfault) - and the artifact was on disk by then, for every later process
    **{
        op: refusal(
            "embedding_bag", "ONNX Runtime crashes loading onnxscript's translation of it; such a piece runs eagerly"
        )
        for op in (_aten._embedding_bag.default, _aten._embedding_bag_forward_only.default)
    },
    _aten._native_batch_norm_legit_no_training.default: batch_norm_no_training,
    _aten._native_batch_norm_legit_functional.default: batch_norm_training,
    _aten._batch_norm_with_update.default: batch_norm_with_update,
    _aten.histc.default: histc_of_data_range,
    _aten.avg_pool2d.default: avg_pool_with_divisor(_aten.avg_pool2d.default, 2),
    _aten.avg_pool3d.default: avg_pool_with_divisor(_aten.avg_pool3d.default, 3),
    _aten._scaled_dot_product_flash_attention_for_cpu.default: masked_attention,
    **{
        op: reduced_float_scaling(op) for op in (_aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar)
    },
    **{op: reduced_float_scaled_sum(op) for op in (_aten.add.Tensor, _aten.sub.Tensor)},
    **{
        inplace: in_place(reduced_float_scaled_sum(op))
        for inplace, op in ((_aten.add_.Tensor, _aten.add.Tensor), (_aten.sub_.Tensor, _aten.sub.Tensor))
    },
    **{
        getattr(_aten, name).Scalar: reduced_float_comparison(getattr(_aten, name).Scalar)
        for name in ("eq", "ne", "lt", "le", "gt", "ge")
    },
    **{
        getattr(_aten, name).Tensor: reduced_float_comparison(getattr(_aten, name).Tensor)
        for name in ("eq", "ne", "lt", "le", "gt", "ge")
    },
}
