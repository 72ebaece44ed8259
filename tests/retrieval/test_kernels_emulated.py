"""The CUDA kernels' bodies, run on the CPU: csrc/retrieval_kernels.cu compiled as C++ with a
shim for the CUDA built-ins, each kernel executed once per (block, thread) in sequence.

The kernels never share memory or synchronise, so this sequential run computes exactly
what the GPU computes; it checks their indexing and clipping against the torch reference on
machines without a GPU (the GPU tests in test_retrieval_ops.py check the real launches).
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.retrieval.ops import assemble_observations, merge_topk

CSRC = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")

FAKE_CUDA_RUNTIME = """#pragma once
typedef int cudaError_t;
typedef struct CUstream_st* cudaStream_t;
enum { cudaSuccess = 0 };
"""

HARNESS = """
#include <cstdint>
struct Dim3Emu { unsigned int x = 0, y = 0, z = 0; };
static Dim3Emu threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
template <class T> inline T __ldg(const T* p) { return *p; }
#define FASTCREDIT_HOST_EMULATION
#include "retrieval_kernels.cu"

using namespace fastcredit;

template <class F> static void launch(int64_t grid, int block, F body) {
  gridDim.x = static_cast<unsigned int>(grid);
  blockDim.x = static_cast<unsigned int>(block);
  for (int64_t b = 0; b < grid; ++b) {
    blockIdx.x = static_cast<unsigned int>(b);
    for (int t = 0; t < block; ++t) { threadIdx.x = static_cast<unsigned int>(t); body(); }
  }
}

static ObsPieces pieces(const int32_t* tokens, const int64_t* offsets, const int64_t* rows, const int32_t* headers,
                        const int64_t* header_offsets, const int32_t* prefix, const int32_t* sep, const int32_t* suffix,
                        int64_t q, int64_t k, int64_t p, int64_t e, int64_t f, int64_t cap, int64_t budget) {
  return ObsPieces{tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix, q, k, p, e, f, cap, budget};
}

extern "C" {
void emu_merge_topk(const float* s, const int64_t* ids, int64_t S, int64_t Q, int64_t K, int64_t k, \
float* os, int64_t* oi) {
  launch(Q, kMergeThreads, [&] { merge_topk_kernel(s, ids, S, Q, K, k, os, oi); });
}
void emu_obs(const int32_t* tokens, const int64_t* offsets, const int64_t* rows, const int32_t* headers,
             const int64_t* header_offsets, const int32_t* prefix, const int32_t* sep, const int32_t* suffix,
             int64_t q, int64_t k, int64_t p, int64_t e, int64_t f, int64_t cap, int64_t budget,
             int64_t* lengths, const int64_t* cu, int32_t* out, int phase) {
  const ObsPieces ps = pieces(tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix, \
q, k, p, e, f, cap, budget);
  if (phase == 0) launch((q + kLengthThreads - 1) / kLengthThreads, kLengthThreads, \
[&] { obs_lengths_kernel(ps, lengths); });
  else launch(q, kAssembleThreads, [&] { obs_assemble_kernel(ps, cu, out); });
}
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (g++ / c++) on PATH; the CPU and CI setup includes g++ (Debian package g++)")
    d = tmp_path_factory.mktemp("emu")
    (d / "cuda_runtime.h").write_text(FAKE_CUDA_RUNTIME)
    (d / "harness.cpp").write_text(HARNESS)
    lib = d / "emu.so"
    proc = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{d}", f"-I{os.path.abspath(CSRC)}",
                           str(d / "harness.cpp"), "-o", str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def _p(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def emu_merge(lib, scores, ids, k):
    S, Q, K = scores.shape
    s, i = np.ascontiguousarray(scores.numpy()), np.ascontiguousarray(ids.numpy())
    os_, oi = np.full((Q, k), np.nan, np.float32), np.full((Q, k), -7, np.int64)  # poisoned: unwritten slots fail
    lib.emu_merge_topk(_p(s), _p(i), *(ctypes.c_int64(x) for x in (S, Q, K, k)), _p(os_), _p(oi))
    return torch.from_numpy(os_), torch.from_numpy(oi)


@settings(max_examples=40)
@given(S=st.integers(1, 5), Q=st.integers(1, 5), K=st.integers(1, 9), levels=st.sampled_from([2, 4, 1000]),
       seed=st.integers(0, 2**16), data=st.data())
def test_merge_kernel_matches_torch(emu, S, Q, K, levels, seed, data):
    k = data.draw(st.integers(0, S * K))
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randint(0, levels, (S, Q, K), generator=g).float() / levels).sort(2, descending=True).values
    ids = torch.randperm(S * Q * K, generator=g).view(S, Q, K)
    got, want = emu_merge(emu, scores, ids, k), merge_topk(scores, ids, k, impl="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def emu_assemble(lib, tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix, cap, limit):
    arrs = [np.ascontiguousarray(t.numpy())
            for t in (tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix)]
    Q, K = rows.shape
    P, E, F = len(prefix), len(sep), len(suffix)
    budget = -1 if limit is None else limit - P - F
    scalars = [ctypes.c_int64(x) for x in (Q, K, P, E, F, -1 if cap is None else cap, budget)]
    lengths = np.full(Q, -7, np.int64)
    lib.emu_obs(*(_p(a) for a in arrs), *scalars, _p(lengths), None, None, 0)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.full(int(cu[-1]), -7, np.int32)
    lib.emu_obs(*(_p(a) for a in arrs), *scalars, _p(lengths), _p(cu), _p(out), 1)
    return torch.from_numpy(out), torch.from_numpy(cu)


@settings(max_examples=40)
@given(N=st.integers(1, 25), Q=st.integers(1, 6), K=st.integers(1, 6), seed=st.integers(0, 2**16),
       cap=st.one_of(st.none(), st.integers(0, 5)), limit=st.one_of(st.none(), st.integers(5, 30)))
def test_assemble_kernels_match_torch(emu, N, Q, K, seed, cap, limit):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 8, (N,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tokens = torch.randint(100, 1000, (int(offsets[-1]),), generator=g, dtype=torch.int32)
    rows = torch.randint(-1, N, (Q, K), generator=g)
    hl = torch.randint(1, 3, (K,), generator=g)
    header_offsets = torch.cat([torch.zeros(1, dtype=torch.long), hl.cumsum(0)])
    headers = torch.arange(1, int(header_offsets[-1]) + 1, dtype=torch.int32)
    prefix, sep, suffix = (torch.tensor(x, dtype=torch.int32) for x in ([90, 91], [93], [94, 95, 96]))
    args = (tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix)
    got = emu_assemble(emu, *args, cap, limit)
    want = assemble_observations(*args, max_passage_tokens=cap, max_obs_tokens=limit, impl="torch")
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
