// Launchers for the retrieval kernels. Plain CUDA types only, so the kernels compile with
// nvcc and no torch headers; retrieval_ops.cpp wraps them as torch ops.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace fastcredit {

// Stable merge of per-shard top-k lists into one global top-k.
// scores [S, Q, K] float32 (each [K] row sorted descending), ids [S, Q, K] int64 (global
// row ids); out_scores / out_ids [Q, k_out], k_out <= S * K. Ties go to the lower shard,
// then the lower position: the same order as a stable descending sort of the shard-major
// concatenation.
cudaError_t launch_merge_topk(const float* scores, const int64_t* ids, int64_t num_shards, int64_t num_queries,
                              int64_t k_in, int64_t k_out, float* out_scores, int64_t* out_ids,
                              cudaStream_t stream);

// The pieces of every observation, shared by both assembly kernels.
struct ObsPieces {
  const int32_t* tokens;          // [T]   token store
  const int64_t* offsets;         // [N+1] passage spans in tokens
  const int64_t* rows;            // [Q, K] passage rows, < 0 = no passage
  const int32_t* headers;         // [H]   "Doc 1", "Doc 2", ... token ids back to back
  const int64_t* header_offsets;  // [K+1] (at least K headers)
  const int32_t* prefix;          // [P]   "\n\n<information>"
  const int32_t* sep;             // [E]   "\n" between passages
  const int32_t* suffix;          // [F]   "</information>\n\n"
  int64_t num_queries, k, prefix_len, sep_len, suffix_len;
  int64_t max_passage_tokens;     // < 0: no per-passage cap
  int64_t body_budget;            // tokens between the wrappers; < 0: no cap
};

// lengths [Q] int64: tokens of each observation.
cudaError_t launch_obs_lengths(const ObsPieces& p, int64_t* lengths, cudaStream_t stream);

// out [sum lengths] int32, packed at cu_seqlens [Q+1] (exclusive prefix sum of lengths).
cudaError_t launch_obs_assemble(const ObsPieces& p, const int64_t* cu_seqlens, int32_t* out, cudaStream_t stream);

}  // namespace fastcredit
