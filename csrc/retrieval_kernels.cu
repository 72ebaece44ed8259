// Retrieval kernels: per-shard top-k merge and observation assembly from token spans.
// Derivations and the exact output layout: csrc/README.md.
#include "retrieval_kernels.h"

namespace fastcredit {
namespace {

constexpr int kMergeThreads = 128;
constexpr int kLengthThreads = 128;
constexpr int kAssembleThreads = 256;

// Elements of a descending row that precede `v` in the stable order: those >= v when the row
// comes from an earlier shard, those > v when from a later one. Binary search, O(log K).
__device__ __forceinline__ int64_t count_before(const float* row, int64_t k, float v, bool earlier) {
  int64_t lo = 0, hi = k;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    const float x = __ldg(row + mid);
    const bool before = earlier ? (x >= v) : (x > v);
    if (before) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// One block per query. Each candidate finds its global rank by counting, in every other
// shard, the elements that precede it; ranks are a permutation, so every output slot below
// k_out is written exactly once and no sort or atomics are needed.
__global__ void merge_topk_kernel(const float* __restrict__ scores, const int64_t* __restrict__ ids,
                                  int64_t num_shards, int64_t num_queries, int64_t k_in, int64_t k_out,
                                  float* __restrict__ out_scores, int64_t* __restrict__ out_ids) {
  const int64_t q = blockIdx.x;
  const int64_t shard_stride = num_queries * k_in;  // int64: S * Q * K can pass 2^31
  const int64_t total = num_shards * k_in;
  for (int64_t c = threadIdx.x; c < total; c += blockDim.x) {
    const int64_t s = c / k_in, j = c - s * k_in;
    const int64_t at = s * shard_stride + q * k_in + j;
    const float v = scores[at];
    int64_t rank = j;
    for (int64_t t = 0; t < num_shards; ++t) {
      if (t == s) continue;
      rank += count_before(scores + t * shard_stride + q * k_in, k_in, v, t < s);
    }
    if (rank < k_out) {
      out_scores[q * k_out + rank] = v;
      out_ids[q * k_out + rank] = ids[at];
    }
  }
}

__device__ __forceinline__ int64_t passage_len(const ObsPieces& p, int64_t row) {
  const int64_t n = p.offsets[row + 1] - p.offsets[row];
  return p.max_passage_tokens >= 0 && n > p.max_passage_tokens ? p.max_passage_tokens : n;
}

// One thread per query: the walk over K passages is short and sequential by nature.
__global__ void obs_lengths_kernel(ObsPieces p, int64_t* __restrict__ lengths) {
  const int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (q >= p.num_queries) return;
  int64_t body = 0, v = 0;
  for (int64_t r = 0; r < p.k; ++r) {
    const int64_t row = p.rows[q * p.k + r];
    if (row < 0) continue;
    body += (v > 0 ? p.sep_len : 0) + (p.header_offsets[v + 1] - p.header_offsets[v]) + passage_len(p, row);
    ++v;
  }
  if (p.body_budget >= 0 && body > p.body_budget) body = p.body_budget;
  lengths[q] = p.prefix_len + body + p.suffix_len;
}

// Block-cooperative copy of src[0, n) to dst[0, n).
__device__ __forceinline__ void copy_span(int32_t* __restrict__ dst, const int32_t* __restrict__ src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// One block per query. Every thread walks the same pieces (so `pos` stays uniform across
// the block) and the threads share each piece's copy; the body is clipped at the budget
// and the closing wrapper always follows it.
__global__ void obs_assemble_kernel(ObsPieces p, const int64_t* __restrict__ cu_seqlens, int32_t* __restrict__ out) {
  const int64_t q = blockIdx.x;
  int32_t* dst = out + cu_seqlens[q];
  copy_span(dst, p.prefix, p.prefix_len);
  int32_t* body = dst + p.prefix_len;
  const int64_t limit = p.body_budget >= 0 ? p.body_budget : INT64_MAX;
  int64_t pos = 0, v = 0;
  for (int64_t r = 0; r < p.k && pos < limit; ++r) {
    const int64_t row = p.rows[q * p.k + r];
    if (row < 0) continue;
    const int32_t* srcs[3] = {p.sep, p.headers + p.header_offsets[v], p.tokens + p.offsets[row]};
    const int64_t lens[3] = {v > 0 ? p.sep_len : 0, p.header_offsets[v + 1] - p.header_offsets[v], passage_len(p, row)};
    for (int i = 0; i < 3; ++i) {
      const int64_t n = lens[i] < limit - pos ? lens[i] : limit - pos;
      copy_span(body + pos, srcs[i], n);
      pos += n;
    }
    ++v;
  }
  copy_span(body + pos, p.suffix, p.suffix_len);
}

}  // namespace

// Without the launchers, tests/retrieval/test_kernels_emulated.py compiles this file as plain C++
// and runs each kernel body once per (block, thread): the kernels share no memory and never
// synchronise, so that sequential run is exact and checks them on machines without a GPU.
#ifndef FASTCREDIT_HOST_EMULATION

cudaError_t launch_merge_topk(const float* scores, const int64_t* ids, int64_t num_shards, int64_t num_queries,
                              int64_t k_in, int64_t k_out, float* out_scores, int64_t* out_ids,
                              cudaStream_t stream) {
  if (num_queries == 0 || k_out == 0) return cudaSuccess;
  merge_topk_kernel<<<static_cast<unsigned int>(num_queries), kMergeThreads, 0, stream>>>(
      scores, ids, num_shards, num_queries, k_in, k_out, out_scores, out_ids);
  return cudaGetLastError();
}

cudaError_t launch_obs_lengths(const ObsPieces& p, int64_t* lengths, cudaStream_t stream) {
  if (p.num_queries == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned int>((p.num_queries + kLengthThreads - 1) / kLengthThreads);
  obs_lengths_kernel<<<blocks, kLengthThreads, 0, stream>>>(p, lengths);
  return cudaGetLastError();
}

cudaError_t launch_obs_assemble(const ObsPieces& p, const int64_t* cu_seqlens, int32_t* out, cudaStream_t stream) {
  if (p.num_queries == 0) return cudaSuccess;
  obs_assemble_kernel<<<static_cast<unsigned int>(p.num_queries), kAssembleThreads, 0, stream>>>(p, cu_seqlens, out);
  return cudaGetLastError();
}

#endif  // FASTCREDIT_HOST_EMULATION

}  // namespace fastcredit
