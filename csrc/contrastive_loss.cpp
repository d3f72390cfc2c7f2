// Fused in-batch cosine InfoNCE + PromCSE energy-based hinge loss on the CPU, O(N·d) memory.
//
// The N x M cosine matrix is never stored: row blocks (parallel, at::parallel_for) stream column tiles
// whose products run at BLAS speed (at::mm_out / addmm_ on the raw embeddings; the row normalisation
// is fused in as a rank-1 scaling of each tile by the inverse norms). The element-wise tile work uses
// ATen's vectorised kernels (they run single-threaded inside the parallel region).
//
// Three paths:
// - fused_pass (reductions mean/sum, gradients needed, not symmetric; what training runs): forward and
//   backward together, for a uniform per-row upstream gradient that the Python op rescales later. Each
//   row block computes its stripe of logits (rows x M, <= 16 MiB per thread), takes the statistics from
//   it and turns it into dS in place: 3 BLAS products per tile, like the materialising reference.
// - row_pass (forward only): online log-sum-exp per row and a running max/argmax of the cosines over the
//   columns other than the positive (the hardest negative; ties keep the lowest column index); the
//   symmetric term is a second pass with the positives as rows and z1 as columns. Only per-row
//   statistics are kept.
// - contrastive_loss_bwd (any per-row gradient, symmetric): recomputes each tile once and feeds both
//   dA += dS·B and dB += dSᵀ·A (4 products per tile with the forward).
// dB is written without atomics or per-thread copies: rows and columns are split into groups processed in
// rounds in which thread t owns row group t and column group (t + r) mod T (a Latin square schedule), so
// results are deterministic for a given thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "constants.h"

namespace fastprompt {
namespace {

constexpr int64_t kRowBlock = 128;
constexpr int64_t kColTile = 256;
constexpr int64_t kStripeElems = int64_t(1) << 22;  // per-thread stripe budget of the fused pass (16 MiB fp32)
constexpr int64_t kMinStripeRows = 16;
constexpr int64_t kMaxStripeRows = 256;

// One contiguous run of columns: rows [0, z.size(0)) of z are global columns [base, base + rows).
struct Segment {
  at::Tensor z;   // (rows, d), contiguous
  at::Tensor r;   // (rows,) inverse norms
  at::Tensor rt;  // r / temperature: scales a raw tile product into logits (without the bias)
  double bias;    // added to the logit of each row's own column: row i, segment row pos_offset + i
                  // (SimCSE's hard-negative weight: only the anchor's own hard negative is weighted)
  int64_t base;   // global index of the first column
};

struct Tile {
  int seg;
  int64_t begin, end;  // rows of the segment
};

at::Tensor inv_norm(const at::Tensor& z) {
  return at::linalg_vector_norm(z, 2, {1}, false, c10::nullopt).clamp_min_(kCosEps).reciprocal_();
}

Segment make_segment(const at::Tensor& z, const at::Tensor& r, double inv_tau, double bias, int64_t base) {
  return {z, r, r * inv_tau, bias, base};
}

std::vector<Tile> make_tiles(const std::vector<Segment>& segs, int64_t tile) {
  std::vector<Tile> tiles;
  for (int s = 0; s < static_cast<int>(segs.size()); ++s) {
    const int64_t rows = segs[s].z.size(0);
    for (int64_t b = 0; b < rows; b += tile) tiles.push_back({s, b, std::min(b + tile, rows)});
  }
  return tiles;
}

// Per-thread scratch tiles, allocated once per parallel region.
struct Workspace {
  at::Tensor buf, sbuf, vals, idx;
  explicit Workspace(const at::TensorOptions& opts)
      : buf(at::empty({kRowBlock, kColTile}, opts)),
        sbuf(at::empty({kRowBlock, kColTile}, opts)),
        vals(at::empty({kRowBlock}, opts)),
        idx(at::empty({kRowBlock}, opts.dtype(at::kLong))) {}
};

// Runs f(item, workspace) for item in [0, n_items) on the intra-op threads. Items are handed out
// dynamically (an atomic counter) rather than in at::parallel_for's static chunks, so a thread that the
// OS preempts on a busy machine does not leave the others idle at the end.
template <typename F>
void parallel_items(int64_t n_items, const at::TensorOptions& opts, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // worker threads do not inherit the caller's thread-local state: skip autograd explicitly
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    Workspace ws(opts);
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) f(item, ws);
  });
}

// Unbiased logits of a tile, cos/tau = (xs · z_tileᵀ) ∘ rt_tile, where xs are the already normalised
// rows: the row normalisation is applied once per row block, the column one as a scaling of the tile.
at::Tensor logit_tile(const at::Tensor& xs, const Segment& seg, const Tile& t, at::Tensor& buf) {
  const int64_t nc = t.end - t.begin;
  at::Tensor l = buf.narrow(0, 0, xs.size(0)).narrow(1, 0, nc);
  at::mm_out(l, xs, seg.z.narrow(0, t.begin, nc).t());
  l.mul_(seg.rt.narrow(0, t.begin, nc).unsqueeze(0));
  return l;
}

// Streams all column tiles for the rows of x: online logsumexp of the logits (+ segment bias), the
// positive's cosine (row i's positive is global column pos_offset + i) and, if track_hard, the largest
// cosine over the other columns with its index (the hardest negative; exact ties keep the lowest index:
// ATen's max returns the first maximum within a tile and later tiles must be strictly larger).
template <typename scalar_t>
void row_pass(const at::Tensor& x, const at::Tensor& rx, const std::vector<Segment>& segs, int64_t pos_offset,
              double temperature, bool track_hard, at::Tensor& lse, at::Tensor& pos_sim, at::Tensor& hard_sim,
              at::Tensor& hard_idx) {
  const int64_t n = x.size(0);
  const std::vector<Tile> tiles = make_tiles(segs, kColTile);
  const int64_t nblocks = (n + kRowBlock - 1) / kRowBlock;
  const auto opts = x.options();
  constexpr scalar_t kNegInf = -std::numeric_limits<scalar_t>::infinity();
  scalar_t* lse_p = lse.data_ptr<scalar_t>();
  scalar_t* pos_p = pos_sim.data_ptr<scalar_t>();
  scalar_t* hs_p = track_hard ? hard_sim.data_ptr<scalar_t>() : nullptr;
  int64_t* hi_p = track_hard ? hard_idx.data_ptr<int64_t>() : nullptr;

  parallel_items(nblocks, opts, [&](int64_t blk, Workspace& ws) {
    {
      const int64_t r0 = blk * kRowBlock, nr = std::min(r0 + kRowBlock, n) - r0;
      const at::Tensor xs = x.narrow(0, r0, nr) * rx.narrow(0, r0, nr).unsqueeze(1);
      std::vector<scalar_t> m(nr, kNegInf), s(nr, 0), best(nr, kNegInf), pos(nr, kNegInf), shift(nr);
      std::vector<int64_t> best_idx(nr, -1);
      for (const Tile& t : tiles) {
        const Segment& seg = segs[t.seg];
        const int64_t g0 = seg.base + t.begin, g1 = seg.base + t.end;
        at::Tensor l = logit_tile(xs, seg, t, ws.buf);
        scalar_t* lp = l.data_ptr<scalar_t>();
        const int64_t ld = l.stride(0);
        // rows whose positive is in this tile: record its logit (and hide it from the hardest-negative max)
        std::vector<int64_t> hidden;
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t p = pos_offset + r0 + i;
          if (p >= g0 && p < g1) {
            pos[i] = lp[i * ld + (p - g0)];
            if (track_hard) lp[i * ld + (p - g0)] = kNegInf;
            hidden.push_back(i);
          }
        }
        at::Tensor v = ws.vals.narrow(0, 0, nr), vi = ws.idx.narrow(0, 0, nr);
        if (track_hard) {  // on the unbiased logits: the hardest negative is defined on cosines
          at::max_out(v, vi, l, 1);
          for (int64_t i : hidden) lp[i * ld + (pos_offset + r0 + i - g0)] = pos[i];
        }
        // the bias of each row's own column in this segment (after the hardest-negative max)
        std::vector<int64_t> biased;
        if (seg.bias != 0.0) {
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t b = seg.base + pos_offset + r0 + i;
            if (b >= g0 && b < g1) {
              lp[i * ld + (b - g0)] += static_cast<scalar_t>(seg.bias);
              biased.push_back(i);
            }
          }
        }
        if (!track_hard) at::amax_out(v, l, {1});
        const scalar_t* vp = v.data_ptr<scalar_t>();
        const int64_t* ip = vi.data_ptr<int64_t>();
        std::vector<scalar_t> tile_max(vp, vp + nr);
        if (track_hard) {
          for (int64_t i = 0; i < nr; ++i) {
            if (vp[i] > best[i]) { best[i] = vp[i]; best_idx[i] = g0 + ip[i]; }
          }
          for (int64_t i : hidden) tile_max[i] = std::max(tile_max[i], pos[i]);
          for (int64_t i : biased) {
            tile_max[i] = std::max(tile_max[i], lp[i * ld + (seg.base + pos_offset + r0 + i - g0)]);
          }
        }
        for (int64_t i = 0; i < nr; ++i) {
          const scalar_t new_m = std::max(m[i], tile_max[i]);
          s[i] *= std::exp(m[i] - new_m);
          m[i] = new_m;
          shift[i] = new_m;
        }
        const at::Tensor sh = at::from_blob(shift.data(), {nr}, opts);
        const at::Tensor tile_sum = l.sub_(sh.unsqueeze(1)).exp_().sum(1);
        const scalar_t* tp = tile_sum.data_ptr<scalar_t>();
        for (int64_t i = 0; i < nr; ++i) s[i] += tp[i];
      }
      for (int64_t i = 0; i < nr; ++i) {
        lse_p[r0 + i] = m[i] + std::log(s[i]);
        pos_p[r0 + i] = pos[i] * static_cast<scalar_t>(temperature);
        if (track_hard) {
          hs_p[r0 + i] = best[i] * static_cast<scalar_t>(temperature);
          hi_p[r0 + i] = best_idx[i];
        }
      }
    }
  });
}

void check_inputs(const at::Tensor& z1, const at::Tensor& z2, const c10::optional<at::Tensor>& z3,
                  int64_t offset) {
  TORCH_CHECK(z1.device().is_cpu() && z2.device().is_cpu(), "contrastive_loss_cpu: CPU tensors expected");
  TORCH_CHECK(z1.dim() == 2 && z2.dim() == 2 && z1.size(1) == z2.size(1),
              "contrastive_loss_cpu: z1 and z2 must be (rows, d) with the same d");
  TORCH_CHECK(z1.scalar_type() == z2.scalar_type() &&
                  (z1.scalar_type() == at::kFloat || z1.scalar_type() == at::kDouble),
              "contrastive_loss_cpu: float32 or float64 inputs of one dtype expected");
  TORCH_CHECK(offset >= 0 && offset + z1.size(0) <= z2.size(0), "contrastive_loss_cpu: bad positive_offset");
  if (z3.has_value()) {
    TORCH_CHECK(z3->sizes() == z2.sizes() && z3->scalar_type() == z2.scalar_type(),
                "contrastive_loss_cpu: z3 must match z2");
  }
}

// Back through the row normalisation, in place and without (rows x d) temporaries: from dA (the gradient
// w.r.t. z / max(||z||, eps)) to dz = r·dA - r³ (z·dA) z; rows with norm <= eps are only scaled.
void normalize_backward_(at::Tensor& dz, const at::Tensor& z, const at::Tensor& r) {
  const at::Tensor zdz = at::bmm(z.unsqueeze(1), dz.unsqueeze(2)).view({-1});  // row-wise dot products
  const at::Tensor proj = zdz * r.pow(3) * (r < 1.0 / kCosEps);
  dz.mul_(r.unsqueeze(1)).addcmul_(z, proj.unsqueeze(1), -1);
}

// Runs f(slot) for slot in [0, n) on the intra-op threads (independent tasks, one parallel region).
template <typename F>
void parallel_slots(int64_t n, const F& f) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t slot = begin; slot < end; ++slot) f(slot);
  });
}

// Forward and backward in one pass, for a uniform per-row upstream gradient `weight` (reductions mean and
// sum: the Python op rescales by the actual gradient later). Each row block computes its whole stripe of
// logits (rows x M, one GEMM per column segment), takes the log-sum-exp, positive and hardest negative
// from it, turns it into dS in place and uses it for dA (one GEMM) and dB (one GEMM): 3 products per
// tile, as many as the materialising reference, instead of 4 for forward + recomputing backward.
// Blocks run T at a time (T = threads), one stripe each; their dB updates go in T sub-rounds in which
// slot t owns column group (t + k) mod T (Latin square: no atomics, deterministic for a given T).
// Memory: T stripes of (rows x M), kept <= kStripeElems elements each by the row count per block.
template <typename scalar_t>
void fused_pass(const at::Tensor& z1, const at::Tensor& r1, const std::vector<Segment>& segs, int64_t pos_offset,
                double temperature, double hinge_margin, double hinge_weight, double weight, bool track_hard,
                int64_t block_rows, at::Tensor& lse, at::Tensor& pos_sim, at::Tensor& hard_sim,
                at::Tensor& hard_idx, at::Tensor& dz1, std::vector<at::Tensor>& dcols) {
  const int64_t n = z1.size(0), d = z1.size(1);
  int64_t m = 0;
  for (const Segment& seg : segs) m += seg.z.size(0);
  const auto opts = z1.options();
  constexpr scalar_t kNegInf = -std::numeric_limits<scalar_t>::infinity();
  const int64_t nblocks = (n + block_rows - 1) / block_rows;
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nblocks));
  std::vector<at::Tensor> stripe(slots), xs(slots);
  for (int64_t t = 0; t < slots; ++t) {
    stripe[t] = at::empty({block_rows, m}, opts);
    xs[t] = at::empty({block_rows, d}, opts);
  }
  const double inv_tau = 1.0 / temperature, c_ce = weight * inv_tau;
  scalar_t* lse_p = lse.data_ptr<scalar_t>();
  scalar_t* pos_p = pos_sim.data_ptr<scalar_t>();
  scalar_t* hs_p = hard_sim.data_ptr<scalar_t>();
  int64_t* hi_p = hard_idx.data_ptr<int64_t>();

  for (int64_t round0 = 0; round0 < nblocks; round0 += slots) {
    const int64_t active = std::min(slots, nblocks - round0);
    auto rows_of = [&](int64_t t) {
      const int64_t r0 = (round0 + t) * block_rows;
      return std::make_pair(r0, std::min(r0 + block_rows, n) - r0);
    };
    // phase A: logits stripe -> statistics -> dS, all in the slot's stripe
    parallel_slots(active, [&](int64_t t) {
      const auto [r0, nr] = rows_of(t);
      at::Tensor x = xs[t].narrow(0, 0, nr), st = stripe[t].narrow(0, 0, nr);
      at::mul_out(x, z1.narrow(0, r0, nr), r1.narrow(0, r0, nr).unsqueeze(1));
      for (const Segment& seg : segs) {
        at::Tensor part = st.narrow(1, seg.base, seg.z.size(0));
        at::mm_out(part, x, seg.z.t());
        part.mul_(seg.rt.unsqueeze(0));  // unbiased logits cos / tau
      }
      scalar_t* sp = st.data_ptr<scalar_t>();
      const int64_t ld = st.stride(0);
      std::vector<scalar_t> pos(nr), best(nr, kNegInf), shift(nr);
      std::vector<int64_t> best_idx(nr, -1);
      for (int64_t i = 0; i < nr; ++i) pos[i] = sp[i * ld + pos_offset + r0 + i];
      if (track_hard) {
        for (int64_t i = 0; i < nr; ++i) sp[i * ld + pos_offset + r0 + i] = kNegInf;
        auto [v, vi] = st.max(1);  // first maximum: the lowest index on exact ties
        const scalar_t* vp = v.data_ptr<scalar_t>();
        const int64_t* ip = vi.data_ptr<int64_t>();
        for (int64_t i = 0; i < nr; ++i) {
          best[i] = vp[i];
          best_idx[i] = ip[i];
          sp[i * ld + pos_offset + r0 + i] = pos[i];
        }
      }
      for (const Segment& seg : segs) {  // each row's own column of the segment (after the hardest negative)
        if (seg.bias == 0.0) continue;
        for (int64_t i = 0; i < nr; ++i) {
          sp[i * ld + seg.base + pos_offset + r0 + i] += static_cast<scalar_t>(seg.bias);
        }
      }
      const at::Tensor mx = at::amax(st, {1});
      const at::Tensor sum = st.sub_(mx.unsqueeze(1)).exp_().sum(1);  // stripe: exp(logit - max)
      const scalar_t* mp = mx.data_ptr<scalar_t>();
      const scalar_t* sump = sum.data_ptr<scalar_t>();
      std::vector<scalar_t> row_scale(nr);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t row = r0 + i;
        lse_p[row] = mp[i] + std::log(sump[i]);
        pos_p[row] = pos[i] * static_cast<scalar_t>(temperature);
        if (track_hard) {
          hs_p[row] = best[i] * static_cast<scalar_t>(temperature);
          hi_p[row] = best_idx[i];
        }
        row_scale[i] = static_cast<scalar_t>(c_ce) / sump[i];  // softmax / tau, times the row weight
      }
      st.mul_(at::from_blob(row_scale.data(), {nr, 1}, opts));
      // one-hot terms: -(ce + hinge) at the positive, +hinge at the hardest negative
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t row = r0 + i;
        const bool active_hinge = hinge_weight != 0.0 && hinge_margin + hs_p[row] - pos_p[row] > 0;
        const scalar_t c_h = active_hinge ? static_cast<scalar_t>(weight * hinge_weight) : scalar_t(0);
        sp[i * ld + pos_offset + row] -= static_cast<scalar_t>(c_ce) + c_h;
        if (c_h != 0) sp[i * ld + hi_p[row]] += c_h;
      }
    });
    // phase B: dB[group (t + k) mod T] += dS[:, group]ᵀ · A_blk; the last sub-round also does dA for the slot
    for (int64_t k = 0; k < slots; ++k) {
      parallel_slots(active, [&](int64_t t) {
        const auto [r0, nr] = rows_of(t);
        const at::Tensor st = stripe[t].narrow(0, 0, nr), x = xs[t].narrow(0, 0, nr);
        const int64_t g = (t + k) % slots, c0 = m * g / slots, c1 = m * (g + 1) / slots;
        for (size_t s = 0; s < segs.size(); ++s) {
          const int64_t b0 = std::max(c0, segs[s].base), b1 = std::min(c1, segs[s].base + segs[s].z.size(0));
          if (b0 < b1) {
            dcols[s].narrow(0, b0 - segs[s].base, b1 - b0).addmm_(st.narrow(1, b0, b1 - b0).t(), x);
          }
        }
        if (k == slots - 1) {
          at::Tensor da = dz1.narrow(0, r0, nr);
          for (size_t s = 0; s < segs.size(); ++s) {
            at::Tensor part = st.narrow(1, segs[s].base, segs[s].z.size(0));
            part.mul_(segs[s].r.unsqueeze(0));  // the columns enter as unit vectors
            if (s == 0) {
              at::mm_out(da, part, segs[s].z);
            } else {
              da.addmm_(part, segs[s].z);
            }
          }
        }
      });
    }
  }
}

std::vector<Segment> column_segments(const at::Tensor& z2, const c10::optional<at::Tensor>& z3,
                                     double inv_tau, double hard_negative_weight) {
  std::vector<Segment> segs{make_segment(z2, inv_norm(z2), inv_tau, 0.0, 0)};
  if (z3.has_value()) segs.push_back(make_segment(*z3, inv_norm(*z3), inv_tau, hard_negative_weight, z2.size(0)));
  return segs;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> contrastive_loss_bwd(
    const at::Tensor& grad_, const at::Tensor& z1_, const at::Tensor& z2_, const c10::optional<at::Tensor>& z3_,
    const at::Tensor& lse_, const at::Tensor& lse_sym_, const at::Tensor& pos_sim, const at::Tensor& hard_sim,
    const at::Tensor& hard_idx_, double temperature, double hard_negative_weight, double hinge_margin,
    double hinge_weight, bool symmetric, int64_t positive_offset);

// Returns (row_loss, lse, lse_sym, pos_sim, hard_sim, hard_idx, dz1, dz2, dz3). With compute_grad (not
// symmetric) the gradients for a uniform per-row upstream gradient `grad_weight` come along (fused pass);
// otherwise they are empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
contrastive_loss_fwd(const at::Tensor& z1_, const at::Tensor& z2_, const c10::optional<at::Tensor>& z3_,
                     double temperature, double hard_negative_weight, double hinge_margin, double hinge_weight,
                     bool symmetric, int64_t positive_offset, bool track_hardest, bool compute_grad,
                     double grad_weight) {
  at::NoGradGuard no_grad;  // a kernel: autograd is handled by the Python op around it
  check_inputs(z1_, z2_, z3_, positive_offset);
  const at::Tensor z1 = z1_.detach().contiguous(), z2 = z2_.detach().contiguous();
  c10::optional<at::Tensor> z3;
  if (z3_.has_value()) z3 = z3_->detach().contiguous();
  const int64_t n = z1.size(0);
  const double inv_tau = 1.0 / temperature;
  const auto opts = z1.options();
  const std::vector<Segment> segs = column_segments(z2, z3, inv_tau, hard_negative_weight);
  const at::Tensor r1 = inv_norm(z1);

  // outputs are poisoned so a row the kernel forgets shows up as NaN, not as stale memory
  at::Tensor lse = at::full({n}, NAN, opts), pos_sim = at::full({n}, NAN, opts);
  at::Tensor hard_sim = at::full({n}, NAN, opts), hard_idx = at::full({n}, -1, opts.dtype(at::kLong));
  at::Tensor lse_sym = at::full({symmetric ? n : 0}, NAN, opts);
  TORCH_CHECK(!(compute_grad && symmetric), "contrastive_loss_cpu_fwd: compute_grad needs symmetric=False");
  track_hardest = track_hardest || hinge_weight != 0.0;
  const int64_t m = segs.size() * z2.size(0);
  const int64_t stripe_rows = std::min<int64_t>(kMaxStripeRows, kStripeElems / m);
  const bool fused = compute_grad && stripe_rows >= std::min<int64_t>(n, kMinStripeRows);
  // distinct empty tensors: outputs of a custom op must not alias each other
  at::Tensor dz1 = at::empty({0, z1.size(1)}, opts), dz2 = at::empty({0, z1.size(1)}, opts),
             dz3 = at::empty({0, z1.size(1)}, opts);
  if (fused) {
    std::vector<at::Tensor> dcols{at::zeros_like(z2)};
    if (z3.has_value()) dcols.push_back(at::zeros_like(*z3));
    dz1 = at::empty_like(z1);
    AT_DISPATCH_FLOATING_TYPES(z1.scalar_type(), "contrastive_loss_fused", [&] {
      fused_pass<scalar_t>(z1, r1, segs, positive_offset, temperature, hinge_margin, hinge_weight, grad_weight,
                           track_hardest, std::max<int64_t>(1, stripe_rows), lse, pos_sim, hard_sim, hard_idx, dz1,
                           dcols);
    });
    normalize_backward_(dz1, z1, r1);
    for (size_t s = 0; s < dcols.size(); ++s) normalize_backward_(dcols[s], segs[s].z, segs[s].r);
    dz2 = dcols[0];
    if (dcols.size() > 1) dz3 = dcols[1];
  }
  AT_DISPATCH_FLOATING_TYPES(z1.scalar_type(), "contrastive_loss_fwd", [&] {
    if (!fused) {
      row_pass<scalar_t>(z1, r1, segs, positive_offset, temperature, track_hardest, lse, pos_sim, hard_sim,
                         hard_idx);
    }
    if (symmetric) {
      // rows: the positives z2[offset:offset+n]; columns: z1 (the positive of row i is column i)
      const at::Tensor p = z2.narrow(0, positive_offset, n);
      const std::vector<Segment> cols{make_segment(z1, r1, inv_tau, 0.0, 0)};
      at::Tensor unused_pos = at::empty({n}, opts), none;
      row_pass<scalar_t>(p, segs[0].r.narrow(0, positive_offset, n), cols, 0, temperature, false, lse_sym,
                         unused_pos, none, none);
    }
  });
  at::Tensor loss = lse - pos_sim * inv_tau;
  if (symmetric) loss = (loss + lse_sym - pos_sim * inv_tau).mul_(0.5);
  if (hinge_weight != 0.0) loss = loss + (hard_sim - pos_sim + hinge_margin).clamp_min_(0).mul_(hinge_weight);
  if (compute_grad && !fused) {  // stripes would not fit the budget (huge M): recompute, 4 products per tile
    std::tie(dz1, dz2, dz3) =
        contrastive_loss_bwd(at::full({n}, grad_weight, opts), z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx,
                             temperature, hard_negative_weight, hinge_margin, hinge_weight, symmetric, positive_offset);
  }
  return {loss, lse, lse_sym, pos_sim, hard_sim, hard_idx, dz1, dz2, dz3};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> contrastive_loss_bwd(
    const at::Tensor& grad_, const at::Tensor& z1_, const at::Tensor& z2_, const c10::optional<at::Tensor>& z3_,
    const at::Tensor& lse_, const at::Tensor& lse_sym_, const at::Tensor& pos_sim, const at::Tensor& hard_sim,
    const at::Tensor& hard_idx_, double temperature, double hard_negative_weight, double hinge_margin,
    double hinge_weight, bool symmetric, int64_t positive_offset) {
  at::NoGradGuard no_grad;
  check_inputs(z1_, z2_, z3_, positive_offset);
  const at::Tensor z1 = z1_.detach().contiguous(), z2 = z2_.detach().contiguous();
  c10::optional<at::Tensor> z3;
  if (z3_.has_value()) z3 = z3_->detach().contiguous();
  const int64_t n = z1.size(0);
  const double inv_tau = 1.0 / temperature, alpha = symmetric ? 0.5 : 1.0;
  const auto opts = z1.options();
  const at::Tensor grad = grad_.detach().to(opts).contiguous(), lse = lse_.to(opts).contiguous();
  const at::Tensor hard_idx = hard_idx_.contiguous();
  const std::vector<Segment> segs = column_segments(z2, z3, inv_tau, hard_negative_weight);
  const at::Tensor r1 = inv_norm(z1);

  // per-row coefficients of dS: softmax part, hinge part (0 where the hinge is inactive), symmetric part
  const at::Tensor c_ce = grad * (alpha * inv_tau);
  const at::Tensor c_hinge =
      hinge_weight != 0.0 ? grad * hinge_weight * (hard_sim.to(opts) - pos_sim.to(opts) + hinge_margin).gt(0)
                          : at::zeros({n}, opts);
  const at::Tensor c_sym = symmetric ? c_ce : at::zeros({n}, opts);
  const at::Tensor lse_sym = symmetric ? lse_sym_.to(opts).contiguous() : at::zeros({n}, opts);

  at::Tensor dz1 = at::zeros_like(z1);
  std::vector<at::Tensor> dcols{at::zeros_like(z2)};
  if (z3.has_value()) dcols.push_back(at::zeros_like(*z3));

  const std::vector<Tile> tiles = make_tiles(segs, kColTile);
  const int64_t nblocks = (n + kRowBlock - 1) / kRowBlock, ntiles = static_cast<int64_t>(tiles.size());
  // more groups than threads, so that the dynamic hand-out of a round's cells can balance the load
  const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(4 * at::get_num_threads(), std::min(nblocks, ntiles)));
  auto group_range = [](int64_t total, int64_t g, int64_t groups) {
    return std::make_pair(total * g / groups, total * (g + 1) / groups);
  };

  AT_DISPATCH_FLOATING_TYPES(z1.scalar_type(), "contrastive_loss_bwd", [&] {
    const scalar_t* cce = c_ce.data_ptr<scalar_t>();
    const scalar_t* chg = c_hinge.data_ptr<scalar_t>();
    const scalar_t* csy = c_sym.data_ptr<scalar_t>();
    const int64_t* hidx = hard_idx.data_ptr<int64_t>();
    for (int64_t round = 0; round < groups; ++round) {
      parallel_items(groups, opts, [&](int64_t g, Workspace& ws) {
        {
          const auto rows = group_range(nblocks, g, groups);
          const auto cols = group_range(ntiles, (g + round) % groups, groups);
          for (int64_t blk = rows.first; blk < rows.second; ++blk) {
            const int64_t r0 = blk * kRowBlock, r1e = std::min(r0 + kRowBlock, n), nr = r1e - r0;
            const at::Tensor xs = z1.narrow(0, r0, nr) * r1.narrow(0, r0, nr).unsqueeze(1);  // rows of A
            for (int64_t ti = cols.first; ti < cols.second; ++ti) {
              const Tile& t = tiles[ti];
              const Segment& seg = segs[t.seg];
              const int64_t g0 = seg.base + t.begin, nc = t.end - t.begin;
              at::Tensor l = logit_tile(xs, seg, t, ws.buf);
              // symmetric: columns z2[offset + k] are the rows k of the reverse term, softmax over z1 rows
              at::Tensor q;
              int64_t q0 = 0;
              if (symmetric && t.seg == 0) {
                const int64_t j0 = std::max(t.begin, positive_offset), j1 = std::min(t.end, positive_offset + n);
                if (j0 < j1) {
                  const int64_t k0 = j0 - positive_offset, nk = j1 - j0;
                  q0 = j0 - t.begin;
                  q = ws.sbuf.narrow(0, 0, nr).narrow(1, 0, nk);
                  at::sub_out(q, l.narrow(1, q0, nk), lse_sym.narrow(0, k0, nk).unsqueeze(0));
                  q.exp_().mul_(c_sym.narrow(0, k0, nk).unsqueeze(0));
                }
              }
              // dS = c_ce * softmax (+ the symmetric part)
              at::Tensor ds = l.sub_(lse.narrow(0, r0, nr).unsqueeze(1)).exp_();
              scalar_t* dp = ds.data_ptr<scalar_t>();
              const int64_t ld = ds.stride(0);
              if (seg.bias != 0.0) {  // each row's own column of the segment carries the bias
                const scalar_t eb = static_cast<scalar_t>(std::exp(seg.bias));
                for (int64_t i = 0; i < nr; ++i) {
                  const int64_t b = seg.base + positive_offset + r0 + i;
                  if (b >= g0 && b < g0 + nc) dp[i * ld + (b - g0)] *= eb;
                }
              }
              ds.mul_(c_ce.narrow(0, r0, nr).unsqueeze(1));
              if (q.defined()) ds.narrow(1, q0, q.size(1)).add_(q);
              // one-hot terms: -(ce + hinge + sym) at the positive, +hinge at the hardest negative
              for (int64_t i = 0; i < nr; ++i) {
                const int64_t row = r0 + i, p = positive_offset + row, h = hidx[row];
                if (p >= g0 && p < g0 + nc) dp[i * ld + (p - g0)] -= cce[row] + chg[row] + csy[row];
                if (h >= g0 && h < g0 + nc) dp[i * ld + (h - g0)] += chg[row];
              }
              // dB += dSᵀ · A_blk ;  dA += (dS ∘ r_col) · Z_tile  (dA, dB: gradients w.r.t. the unit rows)
              dcols[t.seg].narrow(0, t.begin, nc).addmm_(ds.t(), xs);
              ds.mul_(seg.r.narrow(0, t.begin, nc).unsqueeze(0));
              dz1.narrow(0, r0, nr).addmm_(ds, seg.z.narrow(0, t.begin, nc));
            }
          }
        }
      });
    }
  });

  normalize_backward_(dz1, z1, r1);
  for (size_t s = 0; s < dcols.size(); ++s) normalize_backward_(dcols[s], segs[s].z, segs[s].r);
  at::Tensor dz3 = dcols.size() > 1 ? dcols[1] : at::empty({0, z1.size(1)}, opts);
  return {dz1, dcols[0], dz3};
}

TORCH_LIBRARY_FRAGMENT(fastprompt, m) {
  m.def(
      "contrastive_loss_cpu_fwd(Tensor z1, Tensor z2, Tensor? z3, float temperature, float hard_negative_weight, "
      "float hinge_margin, float hinge_weight, bool symmetric, int positive_offset, bool track_hardest, "
      "bool compute_grad, float grad_weight) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "contrastive_loss_cpu_bwd(Tensor grad, Tensor z1, Tensor z2, Tensor? z3, Tensor lse, Tensor lse_sym, "
      "Tensor pos_sim, Tensor hard_sim, Tensor hard_idx, float temperature, float hard_negative_weight, "
      "float hinge_margin, float hinge_weight, bool symmetric, int positive_offset) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastprompt, CPU, m) {
  m.impl("contrastive_loss_cpu_fwd", &contrastive_loss_fwd);
  m.impl("contrastive_loss_cpu_bwd", &contrastive_loss_bwd);
}

}  // namespace fastprompt
