"""Linear algebra lowered at the matrix's static size (lowering/semantics/lu.py and
triangular.py): each compared with eager in float32 and float64, batched and not, and
eager's errors for singular and non-positive-definite matrices kept (lowering/checks.py).
Every one of these ran as an eager piece before."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from qaic_dynamo import last_compile_report
from qaic_dynamo.counter import compilation_counter


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_like_eager(fn, *args, atol=1e-4):
    want = fn(*args)
    with compilation_counter.expect(num_eager_fallbacks=0, num_eager_unless_calls=0):  # at compile or run time
        got = torch.compile(fn, backend="qaic", fullgraph=True, options={"fallback": "error"})(*args)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol, equal_nan=True)
    report = last_compile_report()
    assert report.eager is None and not any(p.runs_eagerly for p in report.pieces), report.table()


def spd(a):
    return a @ a.mT + torch.eye(a.shape[-1], dtype=a.dtype)


def upper(a):
    return torch.triu(a) + 3 * torch.eye(a.shape[-1], dtype=a.dtype)


OPS = {
    "inv": lambda a, b: torch.linalg.inv(a),
    "inv_ex": lambda a, b: torch.linalg.inv_ex(a),
    "solve": lambda a, b: torch.linalg.solve(a, b),
    "solve_right": lambda a, b: torch.linalg.solve(a, b.mT, left=False),
    "solve_vector": lambda a, b: torch.linalg.solve(a, b[..., 0]),
    "det": lambda a, b: torch.linalg.det(a),
    "slogdet": lambda a, b: torch.linalg.slogdet(a),
    "lu_factor": lambda a, b: torch.linalg.lu_factor(a),
    "lu": lambda a, b: torch.linalg.lu(a),
    "lu_solve": lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True),
    "lu_unpack": lambda a, b: torch.lu_unpack(*torch.linalg.lu_factor(a)),
    "solve_triangular": lambda a, b: torch.linalg.solve_triangular(upper(a), b, upper=True),
    "triangular_solve": lambda a, b: torch.triangular_solve(b, upper(a), transpose=True),
    "cholesky": lambda a, b: torch.linalg.cholesky(spd(a)),
    "cholesky_upper": lambda a, b: torch.linalg.cholesky_ex(spd(a), upper=True),
    "cholesky_solve": lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(spd(a))),
    "cholesky_inverse": lambda a, b: torch.cholesky_inverse(torch.linalg.cholesky(spd(a))),
}


@pytest.mark.parametrize("fn", OPS.values(), ids=OPS.keys())
@pytest.mark.parametrize("batch", [(), (3,)], ids=["matrix", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linalg_compiles_like_eager(fn, batch, dtype):
    torch.manual_seed(0)
    a = torch.randn(*batch, 5, 5, dtype=dtype) + 2 * torch.eye(5, dtype=dtype)
    compiled_like_eager(fn, a, torch.randn(*batch, 5, 2, dtype=dtype))


@pytest.mark.parametrize("shape", [(4, 6), (6, 4)], ids=["wide", "tall"])
def test_lu_of_a_rectangular_matrix(shape):
    compiled_like_eager(lambda a: torch.linalg.lu(a), torch.randn(*shape))


def test_a_singular_matrix_keeps_its_determinant_and_sign():
    a = torch.tensor([[[1.0, 2.0], [2.0, 4.0]], [[0.0, 1.0], [1.0, 0.0]]])
    compiled_like_eager(lambda a: (torch.linalg.det(a), torch.linalg.slogdet(a)), a)


CHECKED = {
    "inv": (torch.linalg.inv, lambda: (torch.stack([torch.eye(2), torch.tensor([[1.0, 2.0], [2.0, 4.0]])]),)),
    "solve": (torch.linalg.solve, lambda: (torch.tensor([[1.0, 2.0], [2.0, 4.0]]), torch.randn(2, 3))),
    "cholesky": (torch.linalg.cholesky, lambda: (-torch.eye(3),)),
    "lu_factor": (torch.linalg.lu_factor, lambda: (torch.zeros(2, 2),)),
}


@pytest.mark.parametrize("name", CHECKED)
def test_eagers_linalg_errors_are_raised_by_the_compiled_piece(name):
    fn, args = CHECKED[name][0], CHECKED[name][1]()
    with pytest.raises(RuntimeError) as eager:
        fn(*args)
    compiled = torch.compile(fn, backend="qaic", options={"fallback": "error"})
    with pytest.raises(type(eager.value)) as got:
        compiled(*args)
    assert str(got.value) == str(eager.value)
    assert not any(p.runs_eagerly for p in last_compile_report().pieces)
    # and the same piece, given a good matrix, answers
    good = [
        torch.eye(a.shape[-1]).expand(a.shape).clone() if a.dim() >= 2 and a.shape[-1] == a.shape[-2] else a
        for a in args
    ]
    torch.testing.assert_close(compiled(*good), fn(*good))


def test_a_matrix_past_the_unrolled_size_runs_eagerly_and_says_why():
    with pytest.warns(RuntimeWarning, match=r"unrolled only up to 32"):
        out = torch.compile(torch.linalg.inv, backend="qaic")(torch.eye(40) * 2)
    torch.testing.assert_close(out, torch.eye(40) / 2)


def test_solving_for_no_columns():
    compiled_like_eager(
        lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), torch.eye(3) * 2, torch.randn(3, 0)
    )


QR = {
    "qr_reduced": lambda a, c: torch.linalg.qr(a),
    "qr_complete": lambda a, c: torch.linalg.qr(a, mode="complete"),
    "qr_r": lambda a, c: torch.linalg.qr(a, mode="r")[1],
    "geqrf": lambda a, c: torch.geqrf(a),
    "householder_product": lambda a, c: torch.linalg.householder_product(
        *torch.geqrf(a if a.shape[-2] >= a.shape[-1] else a.mT)
    ),
    "ormqr": lambda a, c: torch.ormqr(*torch.geqrf(a), c, left=True, transpose=True),
    "ormqr_right": lambda a, c: torch.ormqr(*torch.geqrf(a), c.mT, left=False),
}


@pytest.mark.parametrize("fn", QR.values(), ids=QR.keys())
@pytest.mark.parametrize("shape", [(5, 5), (3, 6, 4), (2, 4, 6)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qr_family_like_lapack(fn, shape, dtype):
    # LAPACK's own reflectors: R's diagonal signs, tau and the packed vectors match eager
    torch.manual_seed(0)
    a = torch.randn(*shape, dtype=dtype)
    compiled_like_eager(fn, a, torch.randn(*shape[:-2], shape[-2], 3, dtype=dtype))


def test_qr_of_a_rank_deficient_matrix():
    a = torch.zeros(4, 3)
    a[:, 1] = 1.0  # two zero columns: reflectors with tau 0
    compiled_like_eager(lambda a: (torch.linalg.qr(a), torch.geqrf(a)), a)


SPECTRA = {
    "eigvalsh": lambda a: torch.linalg.eigvalsh(a @ a.mT),
    "eigvalsh_upper": lambda a: torch.linalg.eigvalsh(a + a.mT, UPLO="U"),
    "svdvals": lambda a: torch.linalg.svdvals(a),
    "matrix_rank": lambda a: torch.linalg.matrix_rank(a),
    "cond": lambda a: torch.linalg.cond(a),
    "nuclear_norm": lambda a: torch.linalg.matrix_norm(a, "nuc"),
    "spectral_norm": lambda a: torch.linalg.matrix_norm(a, 2),
    "pinv": lambda a: torch.linalg.pinv(a),
    "pinv_rtol": lambda a: torch.linalg.pinv(a, rtol=0.3),
    "pinv_atol": lambda a: torch.linalg.pinv(a, atol=0.5),
    "pinv_hermitian": lambda a: torch.linalg.pinv(a @ a.mT, hermitian=True),
}


_SLOW = pytest.mark.slow  # Jacobi's rotations take seconds to lower: the full matrix of cases is slow


@pytest.mark.parametrize("fn", SPECTRA.values(), ids=SPECTRA.keys())
@pytest.mark.parametrize(
    "shape",
    [(4, 4), pytest.param((3, 6, 4), marks=_SLOW), pytest.param((2, 4, 6), marks=_SLOW)],
    ids=["square", "tall", "wide"],
)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=_SLOW)])
def test_eigenvalues_singular_values_and_pseudo_inverse(fn, shape, dtype):
    torch.manual_seed(0)
    a = torch.randn(*shape, dtype=dtype)
    if fn in (SPECTRA["eigvalsh_upper"],) and shape[-1] != shape[-2]:
        a = a[..., : min(shape[-2:]), : min(shape[-2:])]
    if fn is SPECTRA["cond"] and shape[-1] != shape[-2]:
        a = a[..., : min(shape[-2:]), : min(shape[-2:])]
    compiled_like_eager(fn, a)


def test_pinv_and_rank_of_a_singular_matrix():
    a = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]])  # rank 2
    compiled_like_eager(lambda a: (torch.linalg.pinv(a), torch.linalg.matrix_rank(a)), a)


def test_vectors_whose_signs_are_lapacks_still_run_eagerly():
    a = torch.randn(4, 4)
    with pytest.warns(RuntimeWarning, match="_linalg_eigh"):
        got = torch.compile(lambda a: torch.linalg.eigh(a @ a.mT), backend="qaic")(a)
    want = torch.linalg.eigh(a @ a.mT)
    assert torch.equal(got.eigenvalues, want.eigenvalues) and torch.equal(got.eigenvectors, want.eigenvectors)
