// Fused RMSNorm / LayerNorm for CPU: forward and backward, optional weight, bias, residual add.
//
// Layout: x is (M, N) row-major. Rows are split across threads (at::parallel_for); within a row
// the work is vectorized with ATen's Vectorized<acc_t>, where acc_t is float (double for double
// inputs) and float16/bfloat16 elements are widened to float in registers.
//
// Forward, per row (two sweeps over the row, the second one from cache):
//   sweep 1  s = x (+ residual): added in acc_t, rounded to T and stored when there is a
//            residual; accumulate Σd and Σd² with d = s − c.
//   sweep 2  read s again (x, or the stored s) from cache, write y = (s − mean)·rstd·scale + bias.
//            A large float s is not stored in sweep 1 but recomputed here from x and the residual
//            (still in L1) and streamed out (see stream_sum_bytes).
// The norm sees the rounded s it returns, so the backward (which only has the stored s) agrees
// with the forward exactly.
// Statistics: one-pass shifted sums. RMSNorm uses c = 0: rstd = 1/sqrt(Σs²/N + eps).
// LayerNorm uses c = s[0], the row's first element: mean = c + Σd/N,
// var = Σd²/N − (Σd/N)². Shifting by a sample of the row keeps Σd/N on the scale of the
// standard deviation, so the subtraction does not cancel catastrophically when |mean| ≫ std
// (the failure of the naive E[s²] − E[s]²); it costs nothing extra, unlike Welford's divisions.
//
// Backward, per row, with x̂ = (s − mean)·rstd and g = dy·scale:
//   sweep 1  Σg and Σg·x̂
//   sweep 2  dx = rstd·(g − Σg/N − x̂·Σg·x̂/N) (+ ds)   (RMSNorm: no Σg/N term)
//            dweight += dy·x̂, dbias += dy into this thread's partial row; partial rows are
//            summed after the parallel loop.
#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "center_cpu.h"
#include "output_cache.h"

namespace {

using at::vec::Vectorized;

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Vectorized<acc_t<T>>::size() elements of T, widened to acc_t.
template <typename T>
inline Vectorized<acc_t<T>> load_acc(const T* p) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return Vectorized<T>::loadu(p);
  } else {
    Vectorized<float> v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

template <typename T>
inline void store_acc(T* p, const Vectorized<acc_t<T>>& v) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, Vectorized<float>::size());
  }
}

// Caller-given outputs (``out=``) at least this large are written with non-temporal (streaming)
// stores: they cannot stay in cache anyway, and streaming skips the read-for-ownership of each
// destination line, so a row costs one read and one write of DRAM traffic instead of two reads and
// a write (glibc's memcpy, and so torch's copy_, does the same above a similar size). Outputs we
// allocate are not streamed: at this size they are fresh pages, which the OS zeroes through the
// cache on first touch, and streaming over those lines measured slower (27 vs 25 ms at 4096×4096).
constexpr int64_t kStreamBytes = int64_t(16) << 20;

// Store one vector; streaming when asked and possible (float on AVX2/AVX-512, aligned address).
template <typename T>
inline void store_out(T* p, const Vectorized<acc_t<T>>& v, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (stream) return _mm512_stream_ps(p, __m512(v));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (stream) return _mm256_stream_ps(p, __m256(v));
  }
#endif
  store_acc(p, v);
}

// An (M, N) float output of at least min_bytes may be streamed: streaming stores need
// vector-aligned rows; everything else falls back to ordinary stores.
template <typename T>
inline bool can_stream(const T* p, int64_t M, int64_t N, int64_t min_bytes) {
  constexpr int64_t align = sizeof(Vectorized<acc_t<T>>);
  return std::is_same_v<T, float> && M * N * int64_t(sizeof(T)) >= min_bytes &&
         reinterpret_cast<uintptr_t>(p) % align == 0 && (N * int64_t(sizeof(T))) % align == 0;
}

// The residual sum s (the stream a pre-norm model carries to its next add) is streamed when it is at
// least NORMFOLD_STREAM_SUM_KB KiB (default 1024; 0 = never). Its next reader is the add after the
// next sublayer, whose weights and activations (megabytes) evict it from cache first, so caching it
// only costs a read-for-ownership and pushes out lines the sublayer needs. y is not streamed: the
// next matmul reads it at once. Measured in GPT-2 (768 wide, batch 8 × 128, one thread): the fused
// add + norm time per forward 9.0–10.5 → 7.7–8.1 ms. In loops over one call, where s may stay in
// L3, the sign varies: 482 vs 565 µs at (1024, 768) interleaved (e2e_ops.md), slower in a loop of
// that call alone.
std::atomic<int64_t>& stream_sum_bytes() {
  static std::atomic<int64_t> bytes([] {
    const char* env = std::getenv("NORMFOLD_STREAM_SUM_KB");
    const long long kb = env ? std::atoll(env) : 1024;
    return kb > 0 ? int64_t(kb) << 10 : std::numeric_limits<int64_t>::max();
  }());
  return bytes;
}

inline void stream_fence(bool streamed) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (streamed) _mm_sfence();  // make this thread's streaming stores visible before returning
#endif
}

template <typename A>
inline A hsum(const Vectorized<A>& v) {
  alignas(64) A buf[Vectorized<A>::size()];
  v.store(buf);
  A total = 0;
  for (int64_t i = 0; i < Vectorized<A>::size(); ++i) total += buf[i];
  return total;
}

// Rows per parallel chunk: enough elements that a chunk outweighs the threading overhead.
inline int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

// s = round_T(x + residual), stored (unless s_out is null: float only, where rounding is a no-op),
// for one vector; or x alone.
template <typename T, bool kResidual>
inline Vectorized<acc_t<T>> make_s(const T* x, const T* r, T* s_out, int64_t i) {
  if constexpr (kResidual) {
    if (s_out == nullptr) return load_acc(x + i) + load_acc(r + i);
    store_acc(s_out + i, load_acc(x + i) + load_acc(r + i));
    return load_acc(s_out + i);  // the rounded value, back from L1
  } else {
    return load_acc(x + i);
  }
}

template <typename T, bool kResidual>
inline acc_t<T> make_s_scalar(const T* x, const T* r, T* s_out, int64_t i) {
  using A = acc_t<T>;
  if constexpr (kResidual) {
    s_out[i] = T(A(x[i]) + A(r[i]));
    return A(s_out[i]);
  } else {
    return A(x[i]);
  }
}

template <typename T, bool kResidual, bool kWeight, bool kBias>
void forward_rows(const T* x, const T* res, const acc_t<T>* scale, const acc_t<T>* bias, T* y, T* s_out,
                  acc_t<T>* mean_out, acc_t<T>* rstd_out, int64_t M, int64_t N, acc_t<T> eps, bool is_rms,
                  bool out_given) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t K = V::size();
  const bool stream = out_given && can_stream(y, M, N, kStreamBytes);
  const bool stream_s = kResidual && can_stream(s_out, M, N, stream_sum_bytes().load(std::memory_order_relaxed));
  at::parallel_for(0, M, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * N;
      const T* rr = kResidual ? res + row * N : nullptr;
      T* sr = kResidual ? s_out + row * N : nullptr;
      T* sr1 = stream_s ? nullptr : sr;  // sweep 1 stores s unless sweep 2 streams it
      T* yr = y + row * N;
      const A shift = is_rms ? A(0) : make_s_scalar<T, kResidual>(xr, rr, sr, 0);
      const V c(shift);
      // sweep 1: Σd, Σd² with four independent accumulator pairs
      V sum0(0), sum1(0), sum2(0), sum3(0), sq0(0), sq1(0), sq2(0), sq3(0);
      int64_t i = 0;
      for (; i + 4 * K <= N; i += 4 * K) {
        V d0 = make_s<T, kResidual>(xr, rr, sr1, i) - c;
        V d1 = make_s<T, kResidual>(xr, rr, sr1, i + K) - c;
        V d2 = make_s<T, kResidual>(xr, rr, sr1, i + 2 * K) - c;
        V d3 = make_s<T, kResidual>(xr, rr, sr1, i + 3 * K) - c;
        sum0 = sum0 + d0; sum1 = sum1 + d1; sum2 = sum2 + d2; sum3 = sum3 + d3;
        sq0 = at::vec::fmadd(d0, d0, sq0); sq1 = at::vec::fmadd(d1, d1, sq1);
        sq2 = at::vec::fmadd(d2, d2, sq2); sq3 = at::vec::fmadd(d3, d3, sq3);
      }
      for (; i + K <= N; i += K) {
        V d = make_s<T, kResidual>(xr, rr, sr1, i) - c;
        sum0 = sum0 + d;
        sq0 = at::vec::fmadd(d, d, sq0);
      }
      A sum = hsum<A>((sum0 + sum1) + (sum2 + sum3));
      A sq = hsum<A>((sq0 + sq1) + (sq2 + sq3));
      for (; i < N; ++i) {
        A d = make_s_scalar<T, kResidual>(xr, rr, sr, i) - shift;
        sum += d;
        sq += d * d;
      }
      const A mean_d = sum / A(N);
      // is_rms: shift = 0 and the "variance" is the mean square
      const A var = is_rms ? sq / A(N) : std::max<A>(sq / A(N) - mean_d * mean_d, A(0));
      const A mean = is_rms ? A(0) : shift + mean_d;
      const A rstd = A(1) / std::sqrt(var + eps);
      if (mean_out) mean_out[row] = mean;  // the statistics are kept only for a backward
      if (rstd_out) rstd_out[row] = rstd;
      // sweep 2: y = (s − mean)·rstd·scale + bias (subtracting first keeps a constant row exact)
      const V vr(rstd), vmean(mean);
      i = 0;
      for (; i + K <= N; i += K) {
        V s;
        if (stream_s) {  // the sum again from x and r, still in L1, and streamed out with y
          s = load_acc(xr + i) + load_acc(rr + i);
          store_out(sr + i, s, true);
        } else {
          s = load_acc((kResidual ? sr : xr) + i);
        }
        V out = (s - vmean) * vr;
        if constexpr (kWeight) out = out * V::loadu(scale + i);
        if constexpr (kBias) out = out + V::loadu(bias + i);
        store_out(yr + i, out, stream);
      }
      for (; i < N; ++i) {
        A s = A((kResidual ? sr : xr)[i]);
        A out = (s - mean) * rstd;
        if constexpr (kWeight) out *= scale[i];
        if constexpr (kBias) out += bias[i];
        yr[i] = T(out);
      }
    }
    stream_fence(stream || stream_s);
  });
}

template <typename T, bool kDs>
void backward_rows(const T* dy, const T* ds, const T* s, const acc_t<T>* scale, const acc_t<T>* mean,
                   const acc_t<T>* rstd, T* dx, acc_t<T>* dw_partial, acc_t<T>* db_partial, int64_t M, int64_t N,
                   bool is_rms) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr int64_t K = V::size();
  at::parallel_for(0, M, grain_rows(N), [&](int64_t begin, int64_t end) {
    // this thread's partial sums of dweight and dbias, shape (N,) each
    A* dw = dw_partial ? dw_partial + at::get_thread_num() * N : nullptr;
    A* db = db_partial ? db_partial + at::get_thread_num() * N : nullptr;
    for (int64_t row = begin; row < end; ++row) {
      const T* sr = s + row * N;
      const T* dyr = dy + row * N;
      T* dxr = dx + row * N;
      const A mu = is_rms ? A(0) : mean[row];
      const A r = rstd[row];
      const V vmu(mu), vr(r);
      // sweep 1: Σg, Σg·x̂
      V sg0(0), sg1(0), sgx0(0), sgx1(0);
      int64_t i = 0;
      for (; i + 2 * K <= N; i += 2 * K) {
        V xh0 = (load_acc(sr + i) - vmu) * vr, xh1 = (load_acc(sr + i + K) - vmu) * vr;
        V g0 = load_acc(dyr + i) * V::loadu(scale + i), g1 = load_acc(dyr + i + K) * V::loadu(scale + i + K);
        sg0 = sg0 + g0; sg1 = sg1 + g1;
        sgx0 = at::vec::fmadd(g0, xh0, sgx0); sgx1 = at::vec::fmadd(g1, xh1, sgx1);
      }
      for (; i + K <= N; i += K) {
        V xh = (load_acc(sr + i) - vmu) * vr;
        V g = load_acc(dyr + i) * V::loadu(scale + i);
        sg0 = sg0 + g;
        sgx0 = at::vec::fmadd(g, xh, sgx0);
      }
      A sg = hsum<A>(sg0 + sg1), sgx = hsum<A>(sgx0 + sgx1);
      for (; i < N; ++i) {
        A xh = (A(sr[i]) - mu) * r, g = A(dyr[i]) * scale[i];
        sg += g;
        sgx += g * xh;
      }
      const A c1 = is_rms ? A(0) : sg / A(N), c2 = sgx / A(N);
      // sweep 2: dx = rstd·(g − c1 − x̂·c2) (+ ds); partial dweight, dbias
      const V vc1(c1), vc2(c2);
      i = 0;
      for (; i + K <= N; i += K) {
        V xh = (load_acc(sr + i) - vmu) * vr;
        V dyv = load_acc(dyr + i);
        V g = dyv * V::loadu(scale + i);
        V out = vr * (g - vc1 - xh * vc2);
        if constexpr (kDs) out = out + load_acc(ds + row * N + i);
        store_acc(dxr + i, out);
        if (dw) at::vec::fmadd(dyv, xh, V::loadu(dw + i)).store(dw + i);
        if (db) (dyv + V::loadu(db + i)).store(db + i);
      }
      for (; i < N; ++i) {
        A xh = (A(sr[i]) - mu) * r, dyv = A(dyr[i]), g = dyv * scale[i];
        A out = r * (g - c1 - xh * c2);
        if constexpr (kDs) out += A(ds[row * N + i]);
        dxr[i] = T(out);
        if (dw) dw[i] += dyv * xh;
        if (db) db[i] += dyv;
      }
    }
  });
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// t itself when it already is a contiguous tensor of dtype `acc` (no copy), else a converted copy.
at::Tensor as_acc(const at::Tensor& t, at::ScalarType acc) {
  return t.scalar_type() == acc && t.is_contiguous() ? t : t.to(acc).contiguous();
}

// scale = offset + weight in the accumulation dtype, contiguous; None without a weight.
c10::optional<at::Tensor> forward_scale(const c10::optional<at::Tensor>& weight, double offset, at::ScalarType acc) {
  if (!weight.has_value()) return c10::nullopt;
  auto w = as_acc(*weight, acc);
  return offset == 0.0 ? w : w + offset;
}

// The backward's scale: as forward_scale, but ones without a weight.
at::Tensor make_scale(const c10::optional<at::Tensor>& weight, double offset, int64_t n, const at::Tensor& x) {
  auto acc = acc_type(x.scalar_type());
  if (!weight.has_value()) return at::ones({n}, x.options().dtype(acc));
  return *forward_scale(weight, offset, acc);
}

void check_2d(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == x.sizes() && t.is_contiguous() && t.scalar_type() == x.scalar_type(),
              name, " must be a contiguous ", x.scalar_type(), " tensor of shape ", x.sizes(), ", got ",
              t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (non-contiguous)");
}

// Run forward_rows over M rows of N for contiguous x, residual, y, s (all of x's dtype and element
// count); weight/bias any floating dtype of shape (N,). mean/rstd (acc dtype, M) may be null.
void launch_forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual, double eps,
                    double offset, bool is_rms, at::Tensor& y, c10::optional<at::Tensor>& s, void* mean,
                    void* rstd, int64_t M, int64_t N, bool out_given) {
  if (M == 0) return;
  const auto acc = acc_type(x.scalar_type());
  const c10::optional<at::Tensor> scale = forward_scale(weight, offset, acc);
  c10::optional<at::Tensor> bias_acc;
  if (bias.has_value()) bias_acc = as_acc(*bias, acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "normfold_norm_fwd", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* res = residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* s_ptr = s.has_value() ? s->data_ptr<scalar_t>() : nullptr;
    const A* scale_ptr = scale.has_value() ? scale->const_data_ptr<A>() : nullptr;
    const A* bias_ptr = bias_acc.has_value() ? bias_acc->const_data_ptr<A>() : nullptr;
    auto run = [&](auto has_residual, auto has_weight, auto has_bias) {
      forward_rows<scalar_t, decltype(has_residual)::value, decltype(has_weight)::value,
                   decltype(has_bias)::value>(x.const_data_ptr<scalar_t>(), res, scale_ptr, bias_ptr,
                                              y.data_ptr<scalar_t>(), s_ptr, static_cast<A*>(mean),
                                              static_cast<A*>(rstd), M, N, static_cast<A>(eps), is_rms,
                                              out_given);
    };
    using T_ = std::true_type;
    using F_ = std::false_type;
    auto with_residual = [&](auto has_weight, auto has_bias) {
      if (res) run(T_{}, has_weight, has_bias);
      else run(F_{}, has_weight, has_bias);
    };
    if (scale_ptr && bias_ptr) with_residual(T_{}, T_{});
    else if (scale_ptr) with_residual(T_{}, F_{});
    else if (bias_ptr) with_residual(F_{}, T_{});
    else with_residual(F_{}, F_{});
  });
}

// ---------------------------------------------------------------- eager inference entry
// Tensors that may be handed straight to the kernel: a torch.Tensor or Parameter (no subclass),
// strided, on the CPU, and carrying none of the dispatch keys that give a tensor other semantics.
bool plain_cpu_tensor(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  out = THPVariable_Unpack(obj);
  static const c10::DispatchKeySet kOther({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                           c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
                                           c10::DispatchKey::ZeroTensor, c10::DispatchKey::FuncTorchBatched,
                                           c10::DispatchKey::FuncTorchGradWrapper});
  return out.layout() == at::kStrided && out.device().is_cpu() && !out.key_set().has_any(kOther);
}

// A Python float that is finite (and > 0 when asked).
bool plain_float(PyObject* obj, bool positive, double& out) {
  if (!PyFloat_Check(obj)) return false;
  out = PyFloat_AS_DOUBLE(obj);
  return std::isfinite(out) && (!positive || out > 0.0);
}

bool is_kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// Whether the kernel may write ``out`` while it reads ``input``: yes when they share no memory, or
// (``exact_ok``: x, the residual) when out is exactly the input (same memory, sizes, strides), since
// the kernel reads each element before writing it. Anything else (partial overlap, a non-dense
// view of the same storage) is left to the full path, which raises (``_checks.check_out_overlap``).
bool out_may_alias(const at::Tensor& out, const at::Tensor& input, bool exact_ok) {
  if (!out.storage().is_alias_of(input.storage())) return true;
  const auto status = at::get_overlap_status(out, input);
  return status == at::MemOverlapStatus::No || (exact_ok && status == at::MemOverlapStatus::Full);
}

}  // namespace

// The forward a backward needs: y (and s) written for contiguous x of any shape, with N = x.size(-1),
// and the per-row statistics returned, (mean, rstd) in the accumulation dtype (mean undefined for RMSNorm).
std::tuple<at::Tensor, at::Tensor> forward_with_stats(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                                      const c10::optional<at::Tensor>& bias,
                                                      const c10::optional<at::Tensor>& residual, double eps,
                                                      double offset, bool is_rms, at::Tensor& y,
                                                      c10::optional<at::Tensor>& s, bool out_given) {
  const int64_t N = x.size(-1), M = x.numel() / N;
  const auto options = x.options().dtype(acc_type(x.scalar_type()));
  at::Tensor mean = is_rms ? at::Tensor() : at::empty({M}, options);
  at::Tensor rstd = at::empty({M}, options);
  launch_forward(x, weight, bias, residual, eps, offset, is_rms, y, s, mean.defined() ? mean.data_ptr() : nullptr,
                 rstd.data_ptr(), M, N, out_given);
  return {mean, rstd};
}

std::tuple<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, at::Tensor> norm_fwd(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, double eps, double offset, bool is_rms,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& residual_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous 2-D CPU tensor");
  if (residual.has_value()) check_2d(*residual, "residual", x);
  at::Tensor y = out.has_value() ? *out : normfold::empty_output(x);
  check_2d(y, "out", x);
  c10::optional<at::Tensor> s;
  if (residual.has_value()) {
    s = residual_out.has_value() ? *residual_out : normfold::empty_output(x);
    check_2d(*s, "residual_out", x);
  }
  auto [mean, rstd] = forward_with_stats(x, weight, bias, residual, eps, offset, is_rms, y, s, out.has_value());
  return {y, s, mean.defined() ? c10::optional<at::Tensor>(mean) : c10::nullopt, rstd};
}

std::tuple<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>> norm_bwd(
    const at::Tensor& dy, const c10::optional<at::Tensor>& ds, const at::Tensor& s,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
    double offset, bool is_rms, bool has_bias) {
  TORCH_CHECK(s.dim() == 2 && s.is_contiguous() && s.device().is_cpu(), "s must be a contiguous 2-D CPU tensor");
  const int64_t M = s.size(0), N = s.size(1);
  auto acc = acc_type(s.scalar_type());
  check_2d(dy, "dy", s);
  if (ds.has_value()) check_2d(*ds, "ds", s);
  TORCH_CHECK(is_rms || (mean.has_value() && mean->numel() == M), "LayerNorm backward needs the row means");
  auto rstd_acc = rstd.to(acc).contiguous();
  auto mean_acc = is_rms ? at::Tensor() : mean->to(acc).contiguous();
  at::Tensor scale = make_scale(weight, offset, N, s);
  at::Tensor dx = normfold::empty_output(s);
  // one partial row of dweight / dbias per thread, reduced after the loop
  const int64_t threads = at::get_num_threads();
  at::Tensor dw_partial, db_partial;
  if (weight.has_value()) dw_partial = at::zeros({threads, N}, s.options().dtype(acc));
  if (has_bias) db_partial = at::zeros({threads, N}, s.options().dtype(acc));
  if (M > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "normfold_norm_bwd", [&] {
      using A = acc_t<scalar_t>;
      auto run = [&](auto has_ds) {
        backward_rows<scalar_t, decltype(has_ds)::value>(
            dy.const_data_ptr<scalar_t>(), ds.has_value() ? ds->const_data_ptr<scalar_t>() : nullptr,
            s.const_data_ptr<scalar_t>(), scale.const_data_ptr<A>(),
            is_rms ? nullptr : mean_acc.const_data_ptr<A>(), rstd_acc.const_data_ptr<A>(), dx.data_ptr<scalar_t>(),
            dw_partial.defined() ? dw_partial.data_ptr<A>() : nullptr,
            db_partial.defined() ? db_partial.data_ptr<A>() : nullptr, M, N, is_rms);
      };
      if (ds.has_value()) run(std::true_type{});
      else run(std::false_type{});
    });
  }
  c10::optional<at::Tensor> dweight, dbias;
  auto param_dtype = weight.has_value() ? weight->scalar_type() : s.scalar_type();
  if (weight.has_value()) dweight = dw_partial.sum(0).to(param_dtype);
  if (has_bias) dbias = db_partial.sum(0).to(param_dtype);
  return {dx, dweight, dbias};
}

// Autograd for eager training calls, recorded by the C++ autograd engine: the same kernels as the
// registered ops (norm_fwd / norm_bwd) without a Python autograd.Function around them (its apply,
// context and four outputs cost as much as the kernel at (2048, 144)). Inputs: x of any shape with
// N = x.size(-1); weight, bias (N,); residual of x's shape and dtype. Outputs y, and s with a residual.
struct EagerNormFunction : public torch::autograd::Function<EagerNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const c10::optional<at::Tensor>& weight,
                                                const c10::optional<at::Tensor>& bias,
                                                const c10::optional<at::Tensor>& residual, double eps,
                                                double offset, bool is_rms) {
    const at::Tensor xc = x.contiguous();
    c10::optional<at::Tensor> rc;
    if (residual.has_value()) rc = residual->contiguous();
    at::Tensor y = normfold::empty_output(xc);
    c10::optional<at::Tensor> s;
    if (rc.has_value()) s = normfold::empty_output(xc);
    auto [mean, rstd] = forward_with_stats(xc, weight, bias, rc, eps, offset, is_rms, y, s, false);
    // the backward reads the normalized input: x, or the stored sum s (an output, saved as one)
    ctx->save_for_backward({s.has_value() ? *s : xc, weight.value_or(at::Tensor()), mean, rstd});
    ctx->set_materialize_grads(false);  // no zero tensors for an unused y or s
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["is_rms"] = is_rms;
    ctx->saved_data["bias_dtype"] = bias.has_value() ? int64_t(bias->scalar_type()) : int64_t(-1);
    if (s.has_value()) return {y, *s};
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& s = saved[0];
    const c10::optional<at::Tensor> weight = saved[1].defined() ? c10::optional<at::Tensor>(saved[1]) : c10::nullopt;
    const c10::optional<at::Tensor> mean = saved[2].defined() ? c10::optional<at::Tensor>(saved[2]) : c10::nullopt;
    const bool has_residual = grads.size() == 2;
    const int64_t bias_dtype = ctx->saved_data["bias_dtype"].toInt();
    const int64_t N = s.size(-1), M = s.numel() / N;
    // dy is undefined when only the returned stream s was used: its gradient passes straight through
    const at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(s);
    c10::optional<at::Tensor> ds;
    if (has_residual && grads[1].defined()) ds = grads[1].contiguous().view({M, N});
    auto [dx, dweight, dbias] = norm_bwd(dy.view({M, N}), ds, s.view({M, N}), weight, mean, saved[3],
                                         ctx->saved_data["offset"].toDouble(), ctx->saved_data["is_rms"].toBool(),
                                         bias_dtype >= 0);
    dx = dx.view(s.sizes());
    return {dx, dweight.value_or(at::Tensor()),
            dbias.has_value() ? dbias->to(static_cast<at::ScalarType>(bias_dtype)) : at::Tensor(),
            has_residual ? dx : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The functional API's shortcut for eager calls: one C++ call that checks the arguments are plain
// (tensors, dtypes, shapes, numbers) and runs the kernel, allocating only the outputs (no mean/rstd)
// or writing into ``out``; under autograd it records EagerNormFunction instead (no ``out=``).
// Returns y, (y, s) with a residual, or None for anything it does not take — then the caller goes
// the full way, which also raises the errors for bad arguments.
py::object norm_fwd_eager(py::handle x_obj, py::handle weight_obj, py::handle bias_obj, py::handle residual_obj,
                          py::handle eps_obj, py::handle offset_obj, bool is_rms, py::handle out_obj) {
  at::Tensor x;
  double eps, offset;
  if (!plain_cpu_tensor(x_obj.ptr(), x) || !is_kernel_dtype(x.scalar_type()) || x.dim() == 0 ||
      !plain_float(eps_obj.ptr(), true, eps) || !plain_float(offset_obj.ptr(), false, offset))
    return py::none();
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || torch::jit::tracer::isTracing() ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))
    return py::none();
  const int64_t N = x.size(-1);
  if (N == 0) return py::none();
  // under autograd when any input needs a gradient; forward-mode AD (dual tensors) is left to the full path
  const bool grad = at::GradMode::is_enabled();
  bool needs_grad = grad && x.requires_grad();
  if (x._fw_grad(/*level=*/0).defined()) return py::none();
  c10::optional<at::Tensor> params[2];  // weight, bias
  PyObject* param_objs[2] = {weight_obj.ptr(), bias_obj.ptr()};
  for (int k = 0; k < 2; ++k) {
    if (param_objs[k] == Py_None) continue;
    at::Tensor p;
    if (!plain_cpu_tensor(param_objs[k], p) || !p.is_floating_point() || p.dim() != 1 || p.size(0) != N ||
        p._fw_grad(0).defined())
      return py::none();
    needs_grad = needs_grad || (grad && p.requires_grad());
    params[k] = std::move(p);
  }
  c10::optional<at::Tensor> residual;
  at::Tensor r;  // as given: ``residual`` may be a contiguous copy of it
  if (residual_obj.ptr() != Py_None) {
    if (!plain_cpu_tensor(residual_obj.ptr(), r) || r.scalar_type() != x.scalar_type() ||
        r.sizes() != x.sizes() || r._fw_grad(0).defined())
      return py::none();
    needs_grad = needs_grad || (grad && r.requires_grad());
    residual = r;
  }
  if (needs_grad) {
    if (out_obj.ptr() != Py_None) return py::none();  // the full path refuses out= under autograd
    RECORD_FUNCTION(is_rms ? "normfold::rms_norm" : "normfold::layer_norm", std::vector<c10::IValue>({x}));
    torch::autograd::variable_list outputs;
    {
      c10::optional<py::gil_scoped_release> no_gil;  // as below (saved-tensor hooks take it back themselves)
      if (x.numel() >= (int64_t(1) << 16)) no_gil.emplace();
      outputs = EagerNormFunction::apply(x, params[0], params[1], residual, eps, offset, is_rms);
    }
    py::object y_obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outputs[0])));
    if (outputs.size() == 1) return y_obj;
    return py::make_tuple(y_obj, py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outputs[1]))));
  }
  if (residual.has_value() && !r.is_contiguous()) residual = r.contiguous();
  // out= : written in place when it is a plain contiguous tensor of x's shape and dtype
  c10::optional<at::Tensor> out;
  if (out_obj.ptr() != Py_None) {
    at::Tensor o;
    if (!plain_cpu_tensor(out_obj.ptr(), o) || o.scalar_type() != x.scalar_type() || o.sizes() != x.sizes() ||
        !o.is_contiguous() || (grad && o.requires_grad()) || !out_may_alias(o, x, true) ||
        (r.defined() && !out_may_alias(o, r, true)))
      return py::none();
    for (const auto& p : params)
      if (p.has_value() && !out_may_alias(o, *p, false)) return py::none();
    out = std::move(o);
  }
  // visible to torch.profiler as one op, like the registered op the full path calls (free when off)
  RECORD_FUNCTION(is_rms ? "normfold::rms_norm" : "normfold::layer_norm", std::vector<c10::IValue>({x}));
  if (!x.is_contiguous()) x = x.contiguous();
  const int64_t M = N ? x.numel() / N : 0;
  at::Tensor y = out.has_value() ? *out : normfold::empty_output(x);
  c10::optional<at::Tensor> s;
  if (residual.has_value()) s = normfold::empty_output(x);
  {
    // let other Python threads run while a large norm computes; tiny ones keep the GIL (cheaper)
    c10::optional<py::gil_scoped_release> no_gil;
    if (M * N >= (int64_t(1) << 16)) no_gil.emplace();
    launch_forward(x, params[0], params[1], residual, eps, offset, is_rms, y, s, nullptr, nullptr, M, N,
                   out.has_value());
  }
  py::object y_obj = out.has_value() ? py::reinterpret_borrow<py::object>(out_obj)  // the caller's own object
                                     : py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
  if (!s.has_value()) return y_obj;
  return py::make_tuple(y_obj, py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(*s))));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "normfold fused CPU norms";
  m.def("cpu_cache_info", [] { return normfold::OutputCache::instance().info(); },
        "(cached bytes, cached blocks, hits, misses, limit bytes) of the output-buffer cache");
  m.def("set_stream_sum_bytes", [](int64_t bytes) { return stream_sum_bytes().exchange(bytes); },
        "stream residual sums of at least this many bytes (returns the previous threshold)");
  m.def("empty_cpu_cache", [] { normfold::OutputCache::instance().empty(); }, "free every cached output buffer");
  m.def("norm_fwd_eager", &norm_fwd_eager, "eager forward (autograd recorded in C++), or None where the full path is needed",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("eps"), py::arg("offset"),
        py::arg("is_rms"), py::arg("out") = py::none());
  m.def("norm_fwd", &norm_fwd, "fused RMSNorm/LayerNorm forward", py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("residual"), py::arg("eps"), py::arg("offset"), py::arg("is_rms"), py::arg("out") = py::none(),
        py::arg("residual_out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("norm_bwd", &norm_bwd, "fused RMSNorm/LayerNorm backward", py::arg("dy"), py::arg("ds"), py::arg("s"),
        py::arg("weight"), py::arg("mean"), py::arg("rstd"), py::arg("offset"), py::arg("is_rms"),
        py::arg("has_bias"), py::call_guard<py::gil_scoped_release>());
  m.def("center_", &normfold::center_,
        "t <- t - mean(t) along dims[i] per groups[i] elements (None: all), in place; returns the indices left undone",
        py::arg("tensors"), py::arg("dims"), py::arg("groups"), py::call_guard<py::gil_scoped_release>());
}
