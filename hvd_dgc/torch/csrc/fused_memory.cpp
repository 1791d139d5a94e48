// One pass over a gradient for DGC's memory update and the block maxima that
// the sampled-threshold selection scans (hvd_dgc/torch/memory.py,
// compression.py). Eager PyTorch needs four passes for the same work
// (u = m u + g; v += u; block max; block min); memory traffic, not
// arithmetic, is what they cost, so one pass is ~2x faster on a CPU.
//
//   momentum, plain:     u = m * u + g          v = v + u
//   momentum, Nesterov:  u = m * (u + g)        v = (v + u) + g
//   no momentum:         v = v + g                         (error feedback)
//   block_max[b] = max |v[32 b : 32 b + 32]|   for every full block b
//
// Rounding may differ from eager PyTorch by an ulp (its vector kernels may use
// fused multiply-add); every rank runs the same code, so ranks stay identical.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

template <int kMode>  // 0: no momentum, 1: momentum, 2: Nesterov
void run(const float* g, float* u, float* v, float m, float* bmax, int64_t n) {
  const int64_t blocks = n / kBlock;
  at::parallel_for(0, blocks, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o = b * kBlock;
      float mx = 0.f;
      for (int64_t j = o; j < o + kBlock; ++j) {
        float vv;
        if (kMode == 0) {
          vv = v[j] + g[j];
        } else if (kMode == 1) {
          const float uu = m * u[j] + g[j];
          u[j] = uu;
          vv = v[j] + uu;
        } else {
          const float uu = m * (u[j] + g[j]);
          u[j] = uu;
          vv = (v[j] + uu) + g[j];
        }
        v[j] = vv;
        mx = std::max(mx, std::fabs(vv));
      }
      bmax[b] = mx;
    }
  });
  for (int64_t j = blocks * kBlock; j < n; ++j) {  // the tail: no block maximum
    if (kMode == 0) {
      v[j] += g[j];
    } else if (kMode == 1) {
      u[j] = m * u[j] + g[j];
      v[j] += u[j];
    } else {
      u[j] = m * (u[j] + g[j]);
      v[j] = (v[j] + u[j]) + g[j];
    }
  }
}

void check(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
}

void accumulate_block_max(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& v,
                          double momentum, bool nesterov, const torch::Tensor& block_max) {
  const int64_t n = v.numel();
  check(g, "g", n);
  check(v, "v", n);
  check(block_max, "block_max", n / kBlock);
  const float m = static_cast<float>(momentum);
  if (momentum == 0.0) {
    run<0>(g.data_ptr<float>(), nullptr, v.data_ptr<float>(), m, block_max.data_ptr<float>(), n);
    return;
  }
  check(u, "u", n);
  if (nesterov) {
    run<2>(g.data_ptr<float>(), u.data_ptr<float>(), v.data_ptr<float>(), m,
           block_max.data_ptr<float>(), n);
  } else {
    run<1>(g.data_ptr<float>(), u.data_ptr<float>(), v.data_ptr<float>(), m,
           block_max.data_ptr<float>(), n);
  }
}

// Indices i with |flat[i]| >= threshold, in increasing order, scanning only the
// blocks whose maximum reaches it (what selection needs ~0.1% of the time).
torch::Tensor indices_at_least(const torch::Tensor& flat, const torch::Tensor& block_max,
                               double threshold) {
  const int64_t n = flat.numel();
  check(flat, "flat", n);
  check(block_max, "block_max", n / kBlock);
  const float* x = flat.data_ptr<float>();
  const float* bm = block_max.data_ptr<float>();
  const float t = static_cast<float>(threshold);
  std::vector<int64_t> found;
  const int64_t blocks = n / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    if (bm[b] >= t) {
      for (int64_t j = b * kBlock; j < (b + 1) * kBlock; ++j) {
        if (std::fabs(x[j]) >= t) found.push_back(j);
      }
    }
  }
  for (int64_t j = blocks * kBlock; j < n; ++j) {
    if (std::fabs(x[j]) >= t) found.push_back(j);
  }
  auto out = torch::empty({static_cast<int64_t>(found.size())}, torch::kInt64);
  std::copy(found.begin(), found.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.attr("BLOCK") = kBlock;
  mod.def("accumulate_block_max", &accumulate_block_max,
          "DGC memory update and |v| block maxima in one pass (float32, CPU)");
  mod.def("indices_at_least", &indices_at_least,
          "indices where |flat| >= threshold, scanning only blocks that reach it");
}
