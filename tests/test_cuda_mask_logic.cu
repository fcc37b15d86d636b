// The index arithmetic of the cuda mask hook, on the host (no device needed): the kernels'
// per-row windows (mask_window) are the host statement of the masks (mask_key_begin /
// mask_key_end, core/mask.cpp), and the key ranges by which the flash and split-KV kernels skip
// tiles (tile_key_range, dense_tile_range, clip_split_tiles) never skip a key some row sees; the
// keys on which they leave the mask out (tile_key_core) are those every row of the tile sees.
// BA-Att's mask-aware selection on the device classifies key blocks (block_visibility) exactly as
// mask_block_visibility does. The kernels themselves are checked against cpu_ref in
// test_cuda_attention.cpp and test_ba_att_cuda.cpp (on a device).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/attention/split_kv_kernel.cuh"
#include "cuda/common/mask.cuh"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"

using namespace sparsa;
using sparsa::cuda::detail::AttentionArgs;
using sparsa::cuda::detail::SplitKvParams;

namespace {

const Mask kMasks[] = {Mask::causal(),
                       Mask::block_causal(1),
                       Mask::block_causal(7),
                       Mask::block_causal(16),
                       Mask::block_causal(128),
                       Mask::block_causal(int64_t{1} << 50),
                       Mask::sliding_window(0),
                       Mask::sliding_window(3, 5),
                       Mask::sliding_window(100, 0),
                       Mask::sliding_window(5, 100),
                       Mask::sliding_window(int64_t{1} << 50, 0)};
const std::pair<int, int> kShapes[] = {{1, 1},     {17, 33},   {33, 17},  {300, 300}, {130, 700},
                                       {700, 130}, {16, 4099}, {17, 2000}, {40, 3000}, {5, 777}};

AttentionArgs args_of(const Mask& m) {
  AttentionArgs a;
  cuda::detail::mask_args(m, &a);
  return a;
}

}  // namespace

TEST(CudaMaskLogic, WindowIsTheHostStatement) {
  for (const Mask& m : kMasks) {
    const AttentionArgs a = args_of(m);
    for (auto [lq, lkv] : kShapes) {
      for (int i = 0; i < lq; ++i) {
        int kb = -1, ke = -1;
        cuda::detail::mask_window(a, i, lq, lkv, kb, ke);
        const int64_t hb = mask_key_begin(m, i, lq, lkv), he = mask_key_end(m, i, lq, lkv);
        if (he <= hb) {
          ASSERT_LE(ke, kb) << mask_string(m) << " " << lq << "x" << lkv << " query " << i << ": sees no key";
        } else {
          ASSERT_EQ(kb, hb) << mask_string(m) << " " << lq << "x" << lkv << " query " << i;
          ASSERT_EQ(ke, he) << mask_string(m) << " " << lq << "x" << lkv << " query " << i;
        }
      }
    }
  }
}

// Query tiles of 128 and 64 rows, key tiles of 128 and 64: every visible (query, key) pair of a
// tile's rows lies in a key tile the dense walk visits.
TEST(CudaMaskLogic, FlashTilesSkipNoVisibleKey) {
  for (const Mask& m : kMasks) {
    const AttentionArgs a = args_of(m);
    for (auto [lq, lkv] : kShapes) {
      for (int rows : {128, 64}) {
        for (int bn : {128, 64}) {
          const int nkv = (lkv + bn - 1) / bn;
          for (int begin = 0; begin < lq; begin += rows) {
            const int end = std::min(begin + rows, lq);
            int kmin = 0, kmax = 0, first = 0, count = 0;
            cuda::detail::tile_key_range(a, begin, end, lq, lkv, kmin, kmax);
            cuda::detail::dense_tile_range(kmin, kmax, lkv, bn, nkv, first, count);
            ASSERT_GE(first, 0);
            ASSERT_LE(first + count, nkv);
            for (int i = begin; i < end; ++i)
              for (int j = 0; j < lkv; ++j)
                if (mask_visible(m, i, j, lq, lkv)) {
                  ASSERT_TRUE(j >= kmin && j < kmax) << mask_string(m) << " " << lq << "x" << lkv << " tile " << begin;
                  ASSERT_TRUE(j / bn >= first && j / bn < first + count) << mask_string(m) << " key " << j;
                }
          }
        }
      }
    }
  }
}

// The keys a query tile's rows all see (tile_key_core), on which the flash kernels leave the
// per-element mask out: exactly the keys that every row of the tile sees, for every mask and
// shape (a key outside it is hidden from some row, so no visible-to-all key is masked and no tile
// that needs the mask goes without it).
TEST(CudaMaskLogic, TileCoreIsTheKeysEveryRowSees) {
  for (const Mask& m : kMasks) {
    const AttentionArgs a = args_of(m);
    for (auto [lq, lkv] : kShapes) {
      for (int rows : {128, 64}) {
        for (int begin = 0; begin < lq; begin += rows) {
          const int end = std::min(begin + rows, lq);
          int lo = 0, hi = 0;
          cuda::detail::tile_key_core(a, begin, end, lq, lkv, lo, hi);
          for (int j = 0; j < lkv; ++j) {
            bool all = true;
            for (int i = begin; i < end && all; ++i) all = mask_visible(m, i, j, lq, lkv);
            ASSERT_EQ(all, j >= lo && j < hi) << mask_string(m) << " " << lq << "x" << lkv << " rows " << begin
                                              << ".." << end << " key " << j << " core [" << lo << ", " << hi << ")";
          }
        }
      }
    }
  }
}

// Split-KV: GQA-stacked rows (row r = query r % len_q of head r / len_q), 64-row m-tiles, S splits
// of the key tiles; after clipping, every key tile holding a key some row of the m-tile sees is
// still in its split, and no split grows.
TEST(CudaMaskLogic, SplitKvTilesSkipNoVisibleKey) {
  constexpr int kBN = 64;
  for (const Mask& m : kMasks) {
    for (auto [lq, lkv] : kShapes) {
      if (lq > 64) continue;  // the split-KV shapes
      for (int group : {1, 3, 8}) {
        SplitKvParams p;
        static_cast<AttentionArgs&>(p) = args_of(m);
        p.len_q = lq, p.len_kv = lkv, p.group = group, p.rows = group * lq;
        p.num_kv_tiles = (lkv + kBN - 1) / kBN;
        for (int splits : {1, 3, 16}) {
          for (int row0 = 0; row0 < p.rows; row0 += 64) {
            std::vector<bool> kept(p.num_kv_tiles, false);
            for (int s = 0; s < splits; ++s) {
              const int b0 = static_cast<int>(int64_t{s} * p.num_kv_tiles / splits);
              const int n0 = static_cast<int>(int64_t{s + 1} * p.num_kv_tiles / splits) - b0;
              int b = b0, n = n0;
              cuda::detail::clip_split_tiles(p, row0, kBN, b, n);
              ASSERT_GE(n, 0);
              if (n > 0) ASSERT_TRUE(b >= b0 && b + n <= b0 + n0) << "a split grew";
              for (int t = b; t < b + n; ++t) kept[t] = true;
            }
            for (int r = row0; r < std::min(row0 + 64, p.rows); ++r)
              for (int j = 0; j < lkv; ++j)
                if (mask_visible(m, r % lq, j, lq, lkv))
                  ASSERT_TRUE(kept[j / kBN]) << mask_string(m) << " " << lq << "x" << lkv << " group " << group
                                             << " row " << r << " key " << j << " splits " << splits;
          }
        }
      }
    }
  }
}

TEST(CudaMaskLogic, BlockVisibilityIsTheHostStatement) {
  const Mask masks[] = {Mask::none(), Mask::causal(), Mask::block_causal(7), Mask::block_causal(16),
                        Mask::block_causal(64), Mask::block_causal(200), Mask::sliding_window(0),
                        Mask::sliding_window(40), Mask::sliding_window(100, 0), Mask::sliding_window(3, 90)};
  const std::pair<int, int> blocks[] = {{16, 16}, {64, 64}, {64, 16}, {16, 64}, {17, 23}, {128, 128}};
  for (const Mask& m : masks) {
    const AttentionArgs a = args_of(m);
    for (auto [lq, lkv] : kShapes) {
      for (auto [bq, bkv] : blocks) {
        const int nq = (lq + bq - 1) / bq, nk = (lkv + bkv - 1) / bkv;
        std::vector<BlockVisibility> host(nk);
        for (int qb = 0; qb < nq; ++qb) {
          mask_block_visibility(m, qb, bq, bkv, lq, lkv, host.data());
          for (int kb = 0; kb < nk; ++kb) {
            ASSERT_EQ(cuda::detail::block_visibility(a, qb, kb, bq, bkv, lq, lkv), static_cast<int>(host[kb]))
                << mask_string(m) << " " << lq << "x" << lkv << " blocks " << bq << "x" << bkv << " qb " << qb
                << " kb " << kb;
          }
        }
      }
    }
  }
}
