// One pass over a flat gradient for DGC's memory update and the block maxima that
// the sampled-threshold selection scans (hvd_dgc/torch/memory.py, cpu_select.py).
// Eager PyTorch needs four passes for the same work (u = m u + g; v += u; block
// max; block min); memory traffic, not arithmetic, is what they cost, so one pass is
// ~2x faster on a CPU.
//
//   momentum, plain:     u' = m * u + g          v' = v + u'
//   momentum, Nesterov:  u' = m * (u + g)        v' = (v + u') + g
//   no momentum:         v' = v + g                          (error feedback)
//   block_max[b] = max |v'[32 b : 32 b + 32]|   for every full block b (NaN if any is)
//
// u' and v' may be u and v themselves (in place), or other buffers: a step that may
// be undone (skip_nonfinite) writes its update beside the old memory instead of
// copying the old memory first, at no extra cost. An empty v stands for zeros (kZero):
// a v sent whole in place by the dense path is not cleared, nor read again (memory.py).
//
// Registered as the operator torch.ops.hvd_dgc.accumulate, so it dispatches (and a
// TorchDispatchMode counts it) like any other operation.
//
// Rounding may differ from eager PyTorch by an ulp (its vector kernels may use
// fused multiply-add); every rank runs the same code, so ranks stay identical.
#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define HVD_DGC_STREAM 1  // chunk_stream below
#endif

namespace {

constexpr int64_t kBlock = 32;

// On x86-64 each hot loop is compiled for AVX2 and for the baseline, chosen when the
// library loads (as torch's own kernels are); elsewhere for the build's target.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HVD_DGC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVD_DGC_CLONES
#endif

// One chunk of blocks [begin, end): each block updated, then its maximum taken while it
// is in cache, in loops the compiler vectorizes (-fopenmp enables the pragmas). The max
// is NaN for a block holding one: a non-finite gradient shows in the maxima (the guard
// reads them; guard.py).
template <int kMode, bool kZero>  // 0: no momentum, 1: momentum, 2: Nesterov; kZero: v = 0
inline void chunk(const float* g, const float* u, const float* v, float* uo, float* vo,
                  float m, float* bmax, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const int64_t o = b * kBlock;
    if (kMode == 0) {
#pragma omp simd
      for (int64_t j = o; j < o + kBlock; ++j) vo[j] = (kZero ? 0.f : v[j]) + g[j];
    } else if (kMode == 1) {
#pragma omp simd
      for (int64_t j = o; j < o + kBlock; ++j) {
        const float uu = m * u[j] + g[j];
        uo[j] = uu;
        vo[j] = (kZero ? 0.f : v[j]) + uu;
      }
    } else {
#pragma omp simd
      for (int64_t j = o; j < o + kBlock; ++j) {
        const float uu = m * (u[j] + g[j]);
        uo[j] = uu;
        vo[j] = ((kZero ? 0.f : v[j]) + uu) + g[j];
      }
    }
    if (bmax == nullptr) continue;
    float best = 0.f;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t j = o; j < o + kBlock; ++j) {
      const float a = std::fabs(vo[j]);
      best = a > best ? a : best;
      nan |= (vo[j] != vo[j]);
    }
    bmax[b] = nan ? std::nanf("") : best;
  }
}

HVD_DGC_CLONES void chunk_plain(const float* g, const float* v, float* vo, float* bmax,
                                int64_t begin, int64_t end) {
  if (v != nullptr) {
    chunk<0, false>(g, nullptr, v, nullptr, vo, 0.f, bmax, begin, end);
  } else {
    chunk<0, true>(g, nullptr, v, nullptr, vo, 0.f, bmax, begin, end);
  }
}

HVD_DGC_CLONES void chunk_momentum(const float* g, const float* u, const float* v, float* uo,
                                   float* vo, float m, float* bmax, int64_t begin,
                                   int64_t end) {
  if (v != nullptr) {
    chunk<1, false>(g, u, v, uo, vo, m, bmax, begin, end);
  } else {
    chunk<1, true>(g, u, v, uo, vo, m, bmax, begin, end);
  }
}

HVD_DGC_CLONES void chunk_nesterov(const float* g, const float* u, const float* v, float* uo,
                                   float* vo, float m, float* bmax, int64_t begin,
                                   int64_t end) {
  if (v != nullptr) {
    chunk<2, false>(g, u, v, uo, vo, m, bmax, begin, end);
  } else {
    chunk<2, true>(g, u, v, uo, vo, m, bmax, begin, end);
  }
}

// The update of a step that may be undone (skip_nonfinite) goes beside the old memory:
// stored plainly, each line written would first be read in (the cache's write-
// allocate), two more streams over the model than the update itself needs. With AVX2
// the blocks are stored non-temporally instead (straight to memory, not read first)
// and the block maximum taken from the registers; the same arithmetic (a multiply,
// then an add: no fused multiply-add, as in chunk()), so the same bits.
#ifdef HVD_DGC_STREAM

template <int kMode, bool kZero>
__attribute__((target("avx2"))) void chunk_stream(const float* g, const float* u,
                                                  const float* v, float* uo, float* vo,
                                                  float m, float* bmax, int64_t begin,
                                                  int64_t end) {
  const __m256 mm = _mm256_set1_ps(m);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t o = b * kBlock;
    __m256 best = _mm256_setzero_ps();
    __m256 nan = _mm256_setzero_ps();
    for (int64_t j = o; j < o + kBlock; j += 8) {
      const __m256 gg = _mm256_loadu_ps(g + j);
      __m256 vv;
      if (kMode == 0) {
        vv = kZero ? _mm256_add_ps(_mm256_setzero_ps(), gg)
                   : _mm256_add_ps(_mm256_loadu_ps(v + j), gg);
      } else if (kMode == 1) {
        const __m256 uu = _mm256_add_ps(_mm256_mul_ps(mm, _mm256_loadu_ps(u + j)), gg);
        _mm256_stream_ps(uo + j, uu);
        vv = _mm256_add_ps(kZero ? _mm256_setzero_ps() : _mm256_loadu_ps(v + j), uu);
      } else {
        const __m256 uu = _mm256_mul_ps(mm, _mm256_add_ps(_mm256_loadu_ps(u + j), gg));
        _mm256_stream_ps(uo + j, uu);
        vv = _mm256_add_ps(
            _mm256_add_ps(kZero ? _mm256_setzero_ps() : _mm256_loadu_ps(v + j), uu), gg);
      }
      _mm256_stream_ps(vo + j, vv);
      if (bmax != nullptr) {
        best = _mm256_max_ps(_mm256_andnot_ps(sign, vv), best);  // NaN lanes keep best
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(vv, vv, _CMP_UNORD_Q));
      }
    }
    if (bmax == nullptr) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    float top = 0.f;
    for (float x : lanes) top = x > top ? x : top;
    bmax[b] = _mm256_movemask_ps(nan) ? std::nanf("") : top;
  }
  _mm_sfence();
}

// Streaming wants the CPU's AVX2, outputs apart from the inputs and 32-byte aligned.
bool streams(const float* u, const float* v, const float* uo, const float* vo) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 32 == 0; };
  return avx2 && vo != v && aligned(vo) && (uo == nullptr || (uo != u && aligned(uo)));
}
#else
bool streams(const float*, const float*, const float*, const float*) { return false; }
#endif

// One chunk of blocks [begin, end) in the given mode, streamed where it can be.
void update_blocks(int mode, bool stream, const float* g, const float* u, const float* v,
                   float* uo, float* vo, float m, float* bmax, int64_t begin, int64_t end) {
#ifdef HVD_DGC_STREAM
  if (stream) {
    const bool zero = v == nullptr;
    if (mode == 0) {
      zero ? chunk_stream<0, true>(g, u, v, uo, vo, m, bmax, begin, end)
           : chunk_stream<0, false>(g, u, v, uo, vo, m, bmax, begin, end);
    } else if (mode == 1) {
      zero ? chunk_stream<1, true>(g, u, v, uo, vo, m, bmax, begin, end)
           : chunk_stream<1, false>(g, u, v, uo, vo, m, bmax, begin, end);
    } else {
      zero ? chunk_stream<2, true>(g, u, v, uo, vo, m, bmax, begin, end)
           : chunk_stream<2, false>(g, u, v, uo, vo, m, bmax, begin, end);
    }
    return;
  }
#endif
  if (mode == 0) {
    chunk_plain(g, v, vo, bmax, begin, end);
  } else if (mode == 1) {
    chunk_momentum(g, u, v, uo, vo, m, bmax, begin, end);
  } else {
    chunk_nesterov(g, u, v, uo, vo, m, bmax, begin, end);
  }
}

// The same update, element by element, over [lo, hi): tails, and ranges that want no
// block maxima (they need not be whole blocks).
void update_range(int mode, const float* g, const float* u, const float* v, float* uo,
                  float* vo, float m, int64_t lo, int64_t hi) {
  for (int64_t j = lo; j < hi; ++j) {
    const float vj = v != nullptr ? v[j] : 0.f;
    if (mode == 0) {
      vo[j] = vj + g[j];
    } else if (mode == 1) {
      const float uu = m * u[j] + g[j];
      uo[j] = uu;
      vo[j] = vj + uu;
    } else {
      const float uu = m * (u[j] + g[j]);
      uo[j] = uu;
      vo[j] = (vj + uu) + g[j];
    }
  }
}

void run(int mode, const float* g, const float* u, const float* v, float* uo, float* vo,
         float m, float* bmax, int64_t n) {
  const bool stream = streams(u, v, uo, vo);
  const int64_t blocks = n / kBlock;
  at::parallel_for(0, blocks, 512, [&](int64_t begin, int64_t end) {
    update_blocks(mode, stream, g, u, v, uo, vo, m, bmax, begin, end);
  });
  // (no maxima wanted: chunk() skips them when bmax is null)
  update_range(mode, g, u, v, uo, vo, m, blocks * kBlock, n);  // the tail: no maximum
}

void check(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
}

void accumulate(const at::Tensor& g, const at::Tensor& u, const at::Tensor& v,
                const at::Tensor& u_out, const at::Tensor& v_out, double momentum,
                bool nesterov, const c10::optional<at::Tensor>& block_max) {
  const int64_t n = v_out.numel();
  check(g, "g", n);
  if (v.numel() > 0) check(v, "v", n);  // (empty: the old v is zero; see kZero)
  check(v_out, "v_out", n);
  const float* vp = v.numel() > 0 ? v.data_ptr<float>() : nullptr;
  float* bm = nullptr;
  if (block_max.has_value() && block_max->defined()) {
    check(*block_max, "block_max", n / kBlock);
    bm = block_max->data_ptr<float>();
  }
  const float m = static_cast<float>(momentum);
  if (momentum == 0.0) {
    run(0, g.data_ptr<float>(), nullptr, vp, nullptr, v_out.data_ptr<float>(), m, bm, n);
    return;
  }
  check(u, "u", n);
  check(u_out, "u_out", n);
  run(nesterov ? 2 : 1, g.data_ptr<float>(), u.data_ptr<float>(), vp,
      u_out.data_ptr<float>(), v_out.data_ptr<float>(), m, bm, n);
}

// Runs body(s) for every segment s in [0, segments) on torch's threads, each thread
// taking the next segment when it is done with one: a launch's tensors differ in size
// by 1000x (ResNet-50's last block holds most of its weights), so an even split of the
// segments leaves one thread with most of the work.
template <typename Body>
void for_each_segment(int64_t segments, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(segments, at::get_num_threads());
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    for (int64_t s = next++; s < segments; s = next++) body(s);
  });
}

// Keeps the k positions of f whose |x| is largest, in position order. The k-th
// largest magnitude by a radix select on its bits (for non-negative floats, the
// order of the bits as integers is the order of the values): a histogram of the top
// 16 bits finds its bucket, one of the low 16 bits within that bucket the value and
// how many equal to it stay (the first ones). Then one compacting pass. Linear: at
// the warm-up's densities f holds millions of positions, and sorting (or
// nth_element) cost more than the rest of the step. A few thousand candidates (DGC's
// final density: k to 2k per tensor) take an nth_element instead: zeroing the two
// histograms of every tensor cost more than the whole selection.
constexpr size_t kSmallSelect = 1 << 14;

void keep_largest(const float* x, std::vector<int64_t>& f, int64_t k,
                  std::vector<uint32_t>& bits, std::vector<int64_t>& hist) {
  if (k <= 0) {
    f.clear();
    return;
  }
  const size_t n = f.size();
  bits.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[f[i]]);
    std::memcpy(&bits[i], &a, sizeof a);
  }
  if (n < kSmallSelect) {  // two 64k histograms would cost more than the candidates
    std::vector<uint32_t> order(bits.begin(), bits.end());
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(),
                     std::greater<uint32_t>());
    const uint32_t kth = order[k - 1];
    int64_t need = k;
    for (size_t i = 0; i < n; ++i) need -= bits[i] > kth;
    size_t out = 0;  // above kth, and the first `need` equal to it
    for (size_t i = 0; i < n; ++i) {
      if (bits[i] > kth || (bits[i] == kth && need-- > 0)) f[out++] = f[i];
    }
    f.resize(out);
    return;
  }
  hist.assign(1 << 16, 0);
  for (size_t i = 0; i < n; ++i) ++hist[bits[i] >> 16];
  int64_t need = k;  // of the k largest, how many are still to be found
  uint32_t high = 0xffff;
  for (;; --high) {
    if (hist[high] >= need) break;
    need -= hist[high];
  }
  hist.assign(1 << 16, 0);
  for (size_t i = 0; i < n; ++i) hist[bits[i] & 0xffff] += (bits[i] >> 16) == high;
  uint32_t low = 0xffff;
  for (;; --low) {
    if (hist[low] >= need) break;
    need -= hist[low];
  }
  const uint32_t kth = (high << 16) | low;
  size_t out = 0;  // above kth, and the first `need` equal to it
  for (size_t i = 0; i < n; ++i) {
    if (bits[i] > kth || (bits[i] == kth && need-- > 0)) f[out++] = f[i];
  }
  f.resize(out);
}

// One segment's round of DGC's scan: the positions in [lo, hi) of v with |v| >= ts, in
// increasing order, scanning only the blocks whose maximum reaches it (what DGC's
// selection needs: ~0.1% of them), fetched a few blocks ahead so the scattered loads
// overlap; more than k of them: the k largest (DGC's "too many: the exact top-k of the
// candidates"). ``f`` gets them.
void scan_segment(const float* x, const float* bm, int64_t lo, int64_t hi, float ts,
                  int64_t k, std::vector<int64_t>& f, std::vector<int64_t>& hit,
                  std::vector<uint32_t>& bits, std::vector<int64_t>& hist) {
  f.clear();
  hit.clear();  // the blocks that reach the threshold: a pass over the maxima
  for (int64_t b = lo / kBlock; b * kBlock < hi; ++b) {
    if (bm[b] >= ts) hit.push_back(b);
  }
  constexpr size_t kAhead = 8;
  for (size_t i = 0; i < hit.size(); ++i) {
    if (i + kAhead < hit.size()) {
      __builtin_prefetch(x + hit[i + kAhead] * kBlock);
      __builtin_prefetch(x + hit[i + kAhead] * kBlock + 16);
    }
    const int64_t start = hit[i] * kBlock, stop = std::min(hi, start + kBlock);
    int64_t block[kBlock];  // without a branch: at the warm-up's densities a
    int64_t c = 0;          // quarter or more pass, and mispredictions dominated
    for (int64_t j = start; j < stop; ++j) {
      block[c] = j;
      c += std::fabs(x[j]) >= ts;
    }
    f.insert(f.end(), block, block + c);
  }
  if (static_cast<int64_t>(f.size()) > k) keep_largest(x, f, k, bits, hist);
}

// Positions grouped by segment, in segment order, and their counts.
std::tuple<at::Tensor, at::Tensor> concat(const std::vector<std::vector<int64_t>>& found) {
  const int64_t segments = static_cast<int64_t>(found.size());
  int64_t total = 0;
  auto counts = at::empty({segments}, at::kLong);
  for (int64_t s = 0; s < segments; ++s) {
    counts.data_ptr<int64_t>()[s] = static_cast<int64_t>(found[s].size());
    total += found[s].size();
  }
  auto positions = at::empty({total}, at::kLong);
  int64_t* pp = positions.data_ptr<int64_t>();
  for (const auto& f : found) pp = std::copy(f.begin(), f.end(), pp);
  return std::make_tuple(positions, counts);
}

struct Segments {  // a launch's segments of a flat v, read once
  at::Tensor off, num, kk, thr;
  const int64_t *o, *n, *k;
  const float* t;
  Segments(const at::Tensor& offsets, const at::Tensor& numels, const at::Tensor& ks,
           const at::Tensor& thresholds)
      : off(offsets.to(at::kLong).contiguous()), num(numels.to(at::kLong).contiguous()),
        kk(ks.to(at::kLong).contiguous()), thr(thresholds.to(at::kFloat).contiguous()),
        o(off.data_ptr<int64_t>()), n(num.data_ptr<int64_t>()), k(kk.data_ptr<int64_t>()),
        t(thr.data_ptr<float>()) {}
};

// DGC's scan and its rounds (cpu_select.adapt_block; tests/reference.py dgc_adapt), for
// every segment s of a flat v (it starts at offsets[s], a multiple of the block, and
// holds numels[s] elements), each on its own: scan_segment at thresholds[s]; fewer than
// ``low`` * ks[s] found: the threshold times ``decay`` (in float32, as the reference)
// and scan again, at most ``rounds`` more times. One call for every round: a
// segment's rounds follow each other on one thread, with no trip back to Python
// between them. An infinite threshold skips its segment. Returns (positions grouped
// by segment, counts, short): short[s] where every round found too few (its count 0;
// the caller takes the exact top-k of the whole segment). One round alone: low 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> scan(
    const at::Tensor& v, const at::Tensor& block_max, const at::Tensor& offsets,
    const at::Tensor& numels, const at::Tensor& thresholds, const at::Tensor& ks,
    double low, double decay, int64_t rounds) {
  check(v, "v", v.numel());
  check(block_max, "block_max", block_max.numel());
  Segments seg(offsets, numels, ks, thresholds);
  const float* x = v.data_ptr<float>();
  const float* bm = block_max.data_ptr<float>();
  const int64_t segments = seg.off.numel();
  const float d = static_cast<float>(decay);
  std::vector<std::vector<int64_t>> found(segments);
  auto short_ = at::zeros({segments}, at::kBool);
  bool* sp = short_.data_ptr<bool>();
  for_each_segment(segments, [&](int64_t s) {
    thread_local std::vector<int64_t> hit;
    thread_local std::vector<uint32_t> bits;
    thread_local std::vector<int64_t> hist;
    float ts = seg.t[s];
    if (std::isinf(ts) && ts > 0) return;
    const double wanted = low * static_cast<double>(seg.k[s]);
    for (int64_t r = 0; r <= rounds; ++r) {
      scan_segment(x, bm, seg.o[s], seg.o[s] + seg.n[s], ts, seg.k[s], found[s], hit, bits,
                   hist);
      if (static_cast<double>(found[s].size()) >= wanted) return;
      ts = ts * d;
    }
    found[s].clear();
    sp[s] = true;
  });
  auto [positions, counts] = concat(found);
  return std::make_tuple(positions, counts, short_);
}

// The k-th largest (0: the largest) of ``sample``, which it may reorder. DGC's final
// density asks for a few dozen of tens of thousands: one pass keeping the k+1 largest
// in a min-heap (most values fail one comparison with its top) costs a fraction of a
// partial sort; the warm-up's densities ask for more, and get nth_element.
float kth_largest(std::vector<float>& sample, int64_t k) {
  const size_t size = sample.size(), keep = static_cast<size_t>(k) + 1;
  if (keep * 64 > size) {
    auto nth = sample.begin() + k;
    std::nth_element(sample.begin(), nth, sample.end(), std::greater<float>());
    return *nth;
  }
  std::vector<float> heap(sample.begin(), sample.begin() + keep);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());  // smallest on top
  for (size_t j = keep; j < size; ++j) {
    if (sample[j] > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = sample[j];
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  }
  return heap.front();
}

// Per segment s, the kth[s]-th largest |v| (0: the largest) of its sample: sizes[s]
// places, base[...] (concatenated over the segments) shifted by shifts[s]. The value
// a top-k of the sample would end at; here one partial sort per segment.
at::Tensor thresholds(const at::Tensor& v, const at::Tensor& base, const at::Tensor& sizes,
                      const at::Tensor& shifts, const at::Tensor& kth) {
  check(v, "v", v.numel());
  const int64_t segments = sizes.numel();
  auto b = base.to(at::kLong).contiguous();
  auto sz = sizes.to(at::kLong).contiguous();
  auto sh = shifts.to(at::kLong).contiguous();
  auto kt = kth.to(at::kLong).contiguous();
  const float* x = v.data_ptr<float>();
  const int64_t* bp = b.data_ptr<int64_t>();
  const int64_t* szp = sz.data_ptr<int64_t>();
  std::vector<int64_t> starts(segments + 1, 0);
  for (int64_t s = 0; s < segments; ++s) starts[s + 1] = starts[s] + szp[s];
  auto out = at::empty({segments}, at::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t* shp = sh.data_ptr<int64_t>();
  const int64_t* ktp = kt.data_ptr<int64_t>();
  for_each_segment(segments, [&](int64_t s) {
    thread_local std::vector<float> sample;
    {
      sample.resize(szp[s]);
      const int64_t* at_ = bp + starts[s];
      for (int64_t j = 0; j < szp[s]; ++j) {
        if (j + 64 < szp[s]) __builtin_prefetch(x + at_[j + 64] + shp[s]);
        sample[j] = std::fabs(x[at_[j] + shp[s]]);
      }
      op[s] = kth_largest(sample, ktp[s]);
    }
  });
  return out;
}

// What leaves the memory at ``positions`` (scattered over it): their values in v,
// returned, and v there cleared, and u too where given (momentum factor masking). One
// pass over the positions, fetched a few ahead so the loads overlap.
at::Tensor take(const at::Tensor& v, const c10::optional<at::Tensor>& u,
                const at::Tensor& positions) {
  check(v, "v", v.numel());
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t count = pos.numel();
  const int64_t* p = pos.data_ptr<int64_t>();
  float* x = v.data_ptr<float>();
  float* y = nullptr;
  if (u.has_value() && u->defined()) {
    check(*u, "u", v.numel());
    y = u->data_ptr<float>();
  }
  auto out = at::empty({count}, at::kFloat);
  float* o = out.data_ptr<float>();
  constexpr int64_t kAhead = 16;
  for (int64_t i = 0; i < count; ++i) {
    if (i + kAhead < count) {
      __builtin_prefetch(x + p[i + kAhead], 1);
      if (y != nullptr) __builtin_prefetch(y + p[i + kAhead], 1);
    }
    o[i] = x[p[i]];
    x[p[i]] = 0.f;
    if (y != nullptr) y[p[i]] = 0.f;
  }
  return out;
}

// accumulate, reading each tensor's gradient (and, for weight decay, its parameter)
// where it lies instead of from one flat buffer: g_i = (grad_i * scale + decay_i * p_i)
// * s_i lands at offsets[i] of the block's buffers, one pass, no staging copy. s_i:
// scales[i] elementwise (Adam's frozen preconditioner, hvd_dgc/adam.py) where it has
// elements; ``scales`` empty for none. Positions between the tensors (zeros) are left
// as they are. block_max (optional) over [lo, hi), which must be whole blocks.
void accumulate_from(at::TensorList grads, at::TensorList params, at::TensorList scales,
                     const at::Tensor& offsets, const at::Tensor& decays, double scale,
                     const at::Tensor& u,
                     const at::Tensor& v, const at::Tensor& u_out, const at::Tensor& v_out,
                     double momentum, bool nesterov, const c10::optional<at::Tensor>& block_max,
                     int64_t lo, int64_t hi) {
  const int64_t members = static_cast<int64_t>(grads.size());
  auto off = offsets.to(at::kLong).contiguous();
  auto dec = decays.to(at::kFloat).contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const float* d = dec.data_ptr<float>();
  std::vector<const float*> gp(members), pp(members), sp(members, nullptr);
  std::vector<int64_t> n(members);
  TORCH_CHECK(scales.empty() || static_cast<int64_t>(scales.size()) == members,
              "scales: one per gradient, or none");
  for (int64_t i = 0; i < members; ++i) {
    check(grads[i], "a gradient", grads[i].numel());
    gp[i] = grads[i].data_ptr<float>();
    n[i] = grads[i].numel();
    pp[i] = nullptr;
    if (d[i] != 0.f) {
      check(params[i], "a parameter", n[i]);
      pp[i] = params[i].data_ptr<float>();
    }
    if (!scales.empty() && scales[i].numel() > 0) {
      check(scales[i], "a scale", n[i]);
      sp[i] = scales[i].data_ptr<float>();
    }
  }
  if (v.numel() > 0) check(v, "v", v_out.numel());  // (empty: the old v is zero)
  check(v_out, "v_out", v_out.numel());
  const float m = static_cast<float>(momentum), sc = static_cast<float>(scale);
  const float* uu = momentum != 0.0 ? u.data_ptr<float>() : nullptr;
  float* uo = momentum != 0.0 ? u_out.data_ptr<float>() : nullptr;
  const float* vv = v.numel() > 0 ? v.data_ptr<float>() : nullptr;
  float* vo = v_out.data_ptr<float>();
  float* bm = nullptr;
  if (block_max.has_value() && block_max->defined()) {
    TORCH_CHECK(lo % kBlock == 0 && hi % kBlock == 0, "block maxima need whole blocks");
    bm = block_max->data_ptr<float>();
  }
  const int mode = momentum == 0.0 ? 0 : (nesterov ? 2 : 1);
  const bool stream = streams(uu, vv, uo, vo);
  constexpr int64_t kChunk = 512 * kBlock;
  at::parallel_for(0, (hi - lo + kChunk - 1) / kChunk, 1, [&](int64_t cb, int64_t ce) {
    std::vector<float> g(kChunk);
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t a = lo + c * kChunk, b = std::min(hi, a + kChunk);
      // this chunk's gradients, from each tensor it overlaps (sorted by offset); a chunk
      // inside one tensor's gradient, with nothing to add or scale, is read where it lies
      int64_t i = std::max<int64_t>(std::upper_bound(o, o + members, a) - o - 1, 0);
      const bool direct = i < members && o[i] <= a && b <= o[i] + n[i] &&
                          pp[i] == nullptr && sp[i] == nullptr && sc == 1.f;
      const float* gs = direct ? gp[i] - o[i] : g.data() - a;
      if (!direct) std::fill(g.begin(), g.begin() + (b - a), 0.f);
      for (; !direct && i < members && o[i] < b; ++i) {
        const int64_t s = std::max(a, o[i]), e = std::min(b, o[i] + n[i]);
        if (s >= e) continue;
        const float* gi = gp[i] + (s - o[i]);
        float* gd = g.data() + (s - a);
        if (pp[i] != nullptr) {
          const float* pi = pp[i] + (s - o[i]);
          const float di = d[i];
#pragma omp simd
          for (int64_t j = 0; j < e - s; ++j) gd[j] = gi[j] * sc + di * pi[j];
        } else {
#pragma omp simd
          for (int64_t j = 0; j < e - s; ++j) gd[j] = gi[j] * sc;
        }
        if (sp[i] != nullptr) {
          const float* si = sp[i] + (s - o[i]);
#pragma omp simd
          for (int64_t j = 0; j < e - s; ++j) gd[j] *= si[j];
        }
      }
      // the update over the chunk (gs: the gradient at the chunk's positions)
      if (bm != nullptr) {
        update_blocks(mode, stream, gs, uu, vv, uo, vo, m, bm, a / kBlock, b / kBlock);
      } else {
        update_range(mode, gs, uu, vv, uo, vo, m, a, b);
      }
    }
  });
}

// Tensors standing for slices of one flat layout (starts: where each begins,
// increasing): a flat position's tensor and the offset in it.
struct Slices {
  Slices(at::TensorList tensors, const at::Tensor& starts, const char* what)
      : starts_(starts.to(at::kLong).contiguous()),
        s(starts_.data_ptr<int64_t>()),
        count(static_cast<int64_t>(tensors.size())),
        t(count),
        n(count) {
    for (int64_t i = 0; i < count; ++i) {
      check(tensors[i], what, tensors[i].numel());
      t[i] = tensors[i].data_ptr<float>();
      n[i] = tensors[i].numel();
    }
  }

  // The tensor holding ``position`` (its offset in ``at``), or -1 if none does.
  int64_t locate(int64_t position, int64_t* at) const {
    const int64_t j = std::upper_bound(s, s + count, position) - s - 1;
    if (j < 0 || position - s[j] >= n[j]) return -1;
    *at = position - s[j];
    return j;
  }

  at::Tensor starts_;
  const int64_t* s;
  int64_t count;
  std::vector<float*> t;
  std::vector<int64_t> n;
};

// Records added into a launch's gradients where they lie: values[i] goes to the tensor
// whose slice of the launch's flat buffers holds positions[i], at positions[i] - its
// start. In record order, as index_add_ adds them into one flat buffer, so the sums
// are the same bit for bit.
void index_add_list(at::TensorList targets, const at::Tensor& starts,
                    const at::Tensor& positions, const at::Tensor& values) {
  const Slices grads(targets, starts, "a gradient");
  auto pos = positions.to(at::kLong).contiguous();
  auto val = values.to(at::kFloat).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* x = val.data_ptr<float>();
  const int64_t count = pos.numel();
  for (int64_t i = 0; i < count; ++i) {
    int64_t at_ = 0;
    const int64_t j = grads.locate(p[i], &at_);
    TORCH_CHECK(j >= 0, "record position ", p[i], " lies in no tensor");
    grads.t[j][at_] += x[i];
  }
}

// SGD's step where a sparse average is non-zero (hvd_dgc/torch/update.py
// step_at_records): params[j] at positions[i] - starts[j] gets alphas[j] *
// grad[positions[i]] (alpha = -lr), as one fused multiply-add, the form torch's vector
// kernels use for add_(g, alpha=...). ``positions`` hold each position once; elsewhere
// the step would add alpha * 0. A position in none of ``params`` (another member's,
// stepped otherwise, or padding between aligned tensors) is passed over.
void sgd_sparse_step(at::TensorList params, const at::Tensor& starts,
                     const at::Tensor& positions, const at::Tensor& grad,
                     const at::Tensor& alphas) {
  const Slices weights(params, starts, "a parameter");
  auto pos = positions.to(at::kLong).contiguous();
  auto al = alphas.to(at::kDouble).contiguous();
  check(grad, "grad", grad.numel());
  const int64_t* p = pos.data_ptr<int64_t>();
  const double* a = al.data_ptr<double>();
  const float* g = grad.data_ptr<float>();
  const int64_t count = pos.numel();
  const int64_t size = grad.numel();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < size, "position ", p[i], " lies outside grad");
  }
  // each position once: the threads never write the same element
  at::parallel_for(0, count, 8192, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t at_ = 0;
      const int64_t j = weights.locate(p[i], &at_);
      if (j < 0) continue;
      weights.t[j][at_] = std::fma(static_cast<float>(a[j]), g[p[i]], weights.t[j][at_]);
    }
  });
}

// -- positions coded near their information content (hvd_dgc/packing.py) ---------------
// One bit stream, least significant bit first. A bitmap: bit p set for each position p.
// Elias-Fano: position i's low `low` bits at bits [i low, (i + 1) low), then bit
// (p_i >> low) + i of a bit vector that starts at bit k low. The layout decisions
// (which code, `low`, the size) are packing.py's; these write and read the bits.

// `positions`: k sorted, distinct int64 in 0..n-1 -> `nbytes` bytes.
at::Tensor encode_positions(const at::Tensor& positions, int64_t n, int64_t low, bool bitmap,
                            int64_t nbytes) {
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong &&
              positions.dim() == 1, "hvd_dgc: encode_positions wants contiguous int64");
  const int64_t k = positions.numel();
  const int64_t* p = positions.data_ptr<int64_t>();
  std::vector<uint64_t> words((nbytes + 7) / 8 + 1, 0);
  auto set = [&](int64_t bit) { words[bit >> 6] |= uint64_t(1) << (bit & 63); };
  if (bitmap) {
    for (int64_t i = 0; i < k; ++i) set(p[i]);
  } else {
    const uint64_t mask = low ? (low == 64 ? ~uint64_t(0) : (uint64_t(1) << low) - 1) : 0;
    for (int64_t i = 0; i < k; ++i) {
      if (low) {
        const uint64_t bits = static_cast<uint64_t>(p[i]) & mask;
        const int64_t at = i * low, word = at >> 6, shift = at & 63;
        words[word] |= bits << shift;
        if (shift + low > 64) words[word + 1] |= bits >> (64 - shift);
      }
      set(k * low + (p[i] >> low) + i);
    }
  }
  at::Tensor out = at::empty({nbytes}, positions.options().dtype(at::kByte));
  std::memcpy(out.data_ptr<uint8_t>(), words.data(), nbytes);  // little-endian words
  return out;
}

// Each row of `blobs` (rows of one length, each k positions among n coded as above) ->
// (rows, k) int64, sorted.
at::Tensor decode_positions(const at::Tensor& blobs, int64_t n, int64_t k, int64_t low,
                            bool bitmap) {
  TORCH_CHECK(blobs.is_contiguous() && blobs.scalar_type() == at::kByte && blobs.dim() == 2,
              "hvd_dgc: decode_positions wants contiguous uint8 rows");
  const int64_t rows = blobs.size(0), width = blobs.size(1);
  at::Tensor out = at::empty({rows, k}, blobs.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const uint8_t* b = blobs.data_ptr<uint8_t>();
  const int64_t nwords = (width + 7) / 8 + 1;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<uint64_t> words(nwords);
    for (int64_t r = r0; r < r1; ++r) {
      std::fill(words.begin(), words.end(), 0);
      std::memcpy(words.data(), b + r * width, width);
      int64_t* row = o + r * k;
      const int64_t start = bitmap ? 0 : k * low;  // the bit vector's first bit
      const int64_t end = bitmap ? n : width * 8;
      int64_t found = 0;
      for (int64_t w = start >> 6; w * 64 < end && found < k; ++w) {
        uint64_t word = words[w];
        if (w == (start >> 6)) word &= ~uint64_t(0) << (start & 63);
        while (word && found < k) {
          const int64_t bit = w * 64 + __builtin_ctzll(word) - start;
          word &= word - 1;
          row[found] = bitmap ? bit : ((bit - found) << low);
          ++found;
        }
      }
      TORCH_CHECK(found == k, "hvd_dgc: a position code holds ", found, " positions, not ",
                  k);
      if (!bitmap && low) {
        const uint64_t mask = low == 64 ? ~uint64_t(0) : (uint64_t(1) << low) - 1;
        for (int64_t i = 0; i < k; ++i) {
          const int64_t at = i * low, word = at >> 6, shift = at & 63;
          uint64_t bits = words[word] >> shift;
          if (shift + low > 64) bits |= words[word + 1] << (64 - shift);
          row[i] |= static_cast<int64_t>(bits & mask);
        }
      }
    }
  });
  return out;
}

// 0 where every value of ``tensors`` is finite, else NaN: x * 0 is 0 for a finite x and
// NaN for an infinite or NaN one, so the sum cannot overflow as a plain sum can. The
// guard's look at averages Horovod wrote into the gradients in place (update.py
// InPlaceUpdate): one pass and one dispatch for all of them, no parallel region (on a
// busy CPU each of torch's per-tensor sums waits for its thread pool to wake).
HVD_DGC_CLONES float nonfinite_in(const float* x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += x[j] * 0.f;
  return acc;
}

at::Tensor finite_flag(at::TensorList tensors) {
  float acc = 0.f;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "hvd_dgc.finite_flag: contiguous float32 CPU tensors only");
    acc += nonfinite_in(t.data_ptr<float>(), t.numel());
  }
  return at::scalar_tensor(acc, at::kFloat);
}

}  // namespace

TORCH_LIBRARY(hvd_dgc, lib) {
  lib.def("accumulate(Tensor g, Tensor u, Tensor v, Tensor(a!) u_out, Tensor(b!) v_out, "
          "float momentum, bool nesterov, Tensor(c!)? block_max) -> ()");
  lib.def("scan(Tensor v, Tensor block_max, Tensor offsets, Tensor numels, "
          "Tensor thresholds, Tensor ks, float low, float decay, int rounds) "
          "-> (Tensor, Tensor, Tensor)");
  lib.def("thresholds(Tensor v, Tensor base, Tensor sizes, Tensor shifts, Tensor kth) "
          "-> Tensor");
  lib.def("take(Tensor(a!) v, Tensor(b!)? u, Tensor positions) -> Tensor");
  lib.def("index_add_list(Tensor(a!)[] targets, Tensor starts, Tensor positions, "
          "Tensor values) -> ()");
  lib.def("sgd_sparse_step(Tensor(a!)[] params, Tensor starts, Tensor positions, "
          "Tensor grad, Tensor alphas) -> ()");
  lib.def("accumulate_from(Tensor[] grads, Tensor[] params, Tensor[] scales, Tensor offsets, "
          "Tensor decays, "
          "float scale, Tensor u, Tensor v, Tensor(a!) u_out, Tensor(b!) v_out, "
          "float momentum, bool nesterov, Tensor(c!)? block_max, int lo, int hi) -> ()");
  lib.def("encode_positions(Tensor positions, int n, int low, bool bitmap, int nbytes) "
          "-> Tensor");
  lib.def("decode_positions(Tensor blobs, int n, int k, int low, bool bitmap) -> Tensor");
  lib.def("finite_flag(Tensor[] tensors) -> Tensor");
}

TORCH_LIBRARY_IMPL(hvd_dgc, CPU, lib) {
  lib.impl("accumulate", &accumulate);
  lib.impl("scan", &scan);
  lib.impl("thresholds", &thresholds);
  lib.impl("take", &take);
  lib.impl("index_add_list", &index_add_list);
  lib.impl("sgd_sparse_step", &sgd_sparse_step);
  lib.impl("accumulate_from", &accumulate_from);
  lib.impl("encode_positions", &encode_positions);
  lib.impl("decode_positions", &decode_positions);
  lib.impl("finite_flag", &finite_flag);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.attr("BLOCK") = kBlock;
}
