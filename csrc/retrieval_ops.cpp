// Torch ops over the retrieval kernels, registered as torch.ops.fastcredit.*:
//   merge_topk(Tensor scores, Tensor ids, int k) -> (Tensor, Tensor)
//   assemble_observations(Tensor tokens, Tensor offsets, Tensor rows, Tensor headers,
//                         Tensor header_offsets, Tensor prefix, Tensor sep, Tensor suffix,
//                         int max_passage_tokens, int max_obs_tokens) -> (Tensor, Tensor)
// CUDA only: CPU callers use the torch reference in fastcredit/retrieval/ops.py, which
// defines the semantics these kernels are tested against.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "retrieval_kernels.h"

namespace fastcredit {
namespace {

void check_cuda(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), "fastcredit: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == device, "fastcredit: ", name, " is on ", t.device(), " but the op runs on ", device);
  TORCH_CHECK(t.scalar_type() == dtype, "fastcredit: ", name, " must be ", dtype, ", got ", t.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> merge_topk_cuda(const at::Tensor& scores_in, const at::Tensor& ids_in, int64_t k) {
  const at::Device device = scores_in.device();
  check_cuda(scores_in, "scores", at::kFloat, device);
  check_cuda(ids_in, "ids", at::kLong, device);
  TORCH_CHECK(scores_in.dim() == 3, "fastcredit: scores must be [shards, queries, k], got ", scores_in.sizes());
  TORCH_CHECK(ids_in.sizes() == scores_in.sizes(), "fastcredit: ids ", ids_in.sizes(), " != scores ",
              scores_in.sizes());
  const int64_t S = scores_in.size(0), Q = scores_in.size(1), K = scores_in.size(2);
  TORCH_CHECK(k >= 0 && k <= S * K, "fastcredit: k=", k, " must lie in [0, shards * k_in = ", S * K, "]");
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor scores = scores_in.contiguous(), ids = ids_in.contiguous();
  at::Tensor out_scores = at::empty({Q, k}, scores.options());
  at::Tensor out_ids = at::empty({Q, k}, ids.options());
  C10_CUDA_CHECK(launch_merge_topk(scores.data_ptr<float>(), ids.data_ptr<int64_t>(), S, Q, K, k,
                                   out_scores.data_ptr<float>(), out_ids.data_ptr<int64_t>(),
                                   c10::cuda::getCurrentCUDAStream().stream()));
  return {out_scores, out_ids};
}

std::tuple<at::Tensor, at::Tensor> assemble_observations_cuda(
    const at::Tensor& tokens_in, const at::Tensor& offsets_in, const at::Tensor& rows_in, const at::Tensor& headers_in,
    const at::Tensor& header_offsets_in, const at::Tensor& prefix_in, const at::Tensor& sep_in,
    const at::Tensor& suffix_in, int64_t max_passage_tokens, int64_t max_obs_tokens) {
  const at::Device device = rows_in.device();
  check_cuda(tokens_in, "tokens", at::kInt, device);
  check_cuda(offsets_in, "offsets", at::kLong, device);
  check_cuda(rows_in, "rows", at::kLong, device);
  check_cuda(headers_in, "headers", at::kInt, device);
  check_cuda(header_offsets_in, "header_offsets", at::kLong, device);
  check_cuda(prefix_in, "prefix", at::kInt, device);
  check_cuda(sep_in, "sep", at::kInt, device);
  check_cuda(suffix_in, "suffix", at::kInt, device);
  TORCH_CHECK(rows_in.dim() == 2, "fastcredit: rows must be [queries, k], got ", rows_in.sizes());
  const int64_t Q = rows_in.size(0), K = rows_in.size(1);
  TORCH_CHECK(header_offsets_in.dim() == 1 && header_offsets_in.size(0) >= K + 1,
              "fastcredit: header_offsets needs at least k+1 = ", K + 1, " entries, got ", header_offsets_in.sizes());
  const int64_t P = prefix_in.numel(), E = sep_in.numel(), F = suffix_in.numel();
  const int64_t budget = max_obs_tokens < 0 ? -1 : max_obs_tokens - P - F;
  TORCH_CHECK(max_obs_tokens < 0 || budget >= 0, "fastcredit: max_obs_tokens=", max_obs_tokens,
              " cannot hold the wrappers (", P + F, " tokens)");

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor tokens = tokens_in.contiguous(), offsets = offsets_in.contiguous(), rows = rows_in.contiguous();
  const at::Tensor headers = headers_in.contiguous(), header_offsets = header_offsets_in.contiguous();
  const at::Tensor prefix = prefix_in.contiguous(), sep = sep_in.contiguous(), suffix = suffix_in.contiguous();
  ObsPieces p{tokens.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
              headers.data_ptr<int32_t>(), header_offsets.data_ptr<int64_t>(), prefix.data_ptr<int32_t>(),
              sep.data_ptr<int32_t>(), suffix.data_ptr<int32_t>(), Q, K, P, E, F, max_passage_tokens, budget};

  at::Tensor cu_seqlens = at::zeros({Q + 1}, rows.options());
  at::Tensor lengths = at::empty({Q}, rows.options());
  C10_CUDA_CHECK(launch_obs_lengths(p, lengths.data_ptr<int64_t>(), stream));
  cu_seqlens.narrow(0, 1, Q).copy_(lengths.cumsum(0));
  // NOTE: the one host sync of the op: the packed output's size is data-dependent.
  const int64_t total = cu_seqlens[Q].item<int64_t>();
  at::Tensor out = at::empty({total}, tokens.options());
  C10_CUDA_CHECK(launch_obs_assemble(p, cu_seqlens.data_ptr<int64_t>(), out.data_ptr<int32_t>(), stream));
  return {out, cu_seqlens};
}

}  // namespace
}  // namespace fastcredit

// FRAGMENT, not TORCH_LIBRARY: other csrc/ files may add ops to the same namespace.
TORCH_LIBRARY_FRAGMENT(fastcredit, m) {
  m.def("merge_topk(Tensor scores, Tensor ids, int k) -> (Tensor, Tensor)");
  m.def("assemble_observations(Tensor tokens, Tensor offsets, Tensor rows, Tensor headers, Tensor header_offsets, "
        "Tensor prefix, Tensor sep, Tensor suffix, int max_passage_tokens, int max_obs_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastcredit, CUDA, m) {
  m.impl("merge_topk", &fastcredit::merge_topk_cuda);
  m.impl("assemble_observations", &fastcredit::assemble_observations_cuda);
}
