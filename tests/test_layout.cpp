// Token layouts: Z-order and Hilbert permutations of H x W grids and their inverses.
#include <gtest/gtest.h>

#include <cstdlib>

#include "llsa_test_util.h"
#include "sparsa/layout.h"

using namespace sparsa;

namespace {

// Every aligned group of `group` = side^2 consecutive positions covers a side x side
// square of the grid.
bool groups_are_squares(const std::vector<int32_t>& perm, int64_t width, int64_t side) {
  const int64_t group = side * side;
  for (size_t g = 0; g + group <= perm.size(); g += group) {
    int64_t r0 = 1 << 30, r1 = -1, c0 = 1 << 30, c1 = -1;
    for (int64_t i = 0; i < group; ++i) {
      const int64_t r = perm[g + i] / width, c = perm[g + i] % width;
      r0 = std::min(r0, r), r1 = std::max(r1, r), c0 = std::min(c0, c), c1 = std::max(c1, c);
    }
    if (r1 - r0 + 1 != side || c1 - c0 + 1 != side || r0 % side != 0 || c0 % side != 0) return false;
  }
  return true;
}

// Mean over aligned groups of 16 of the bounding box's larger side.
double mean_extent(const std::vector<int32_t>& perm, int64_t width) {
  double total = 0;
  int groups = 0;
  for (size_t g = 0; g + 16 <= perm.size(); g += 16, ++groups) {
    int64_t r0 = 1 << 30, r1 = -1, c0 = 1 << 30, c1 = -1;
    for (int i = 0; i < 16; ++i) {
      const int64_t r = perm[g + i] / width, c = perm[g + i] % width;
      r0 = std::min(r0, r), r1 = std::max(r1, r), c0 = std::min(c0, c), c1 = std::max(c1, c);
    }
    total += std::max(r1 - r0 + 1, c1 - c0 + 1);
  }
  return total / groups;
}

}  // namespace

TEST(Layout, ZOrderOfA4x4) {
  auto perm = layout_permutation(4, 4, TokenLayout::z_order);
  ASSERT_TRUE(perm.ok());
  // (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) (1,2) (1,3) | ...
  const std::vector<int32_t> expected = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};
  EXPECT_EQ(*perm, expected);
}

TEST(Layout, SquaresWheneverTheSidesAllowThem) {
  for (TokenLayout layout : {TokenLayout::z_order, TokenLayout::hilbert}) {
    for (auto [h, w] : {std::pair{64, 64}, std::pair{48, 80}, std::pair{32, 128}, std::pair{16, 16}}) {
      auto perm = layout_permutation(h, w, layout);
      ASSERT_TRUE(perm.ok());
      ASSERT_TRUE(is_permutation(*perm));
      EXPECT_TRUE(groups_are_squares(*perm, w, 2)) << token_layout_name(layout) << " " << h << "x" << w;
      EXPECT_TRUE(groups_are_squares(*perm, w, 4)) << token_layout_name(layout) << " " << h << "x" << w;
      EXPECT_TRUE(groups_are_squares(*perm, w, 16)) << token_layout_name(layout) << " " << h << "x" << w;
    }
  }
  // Row-major is the control: its groups of 16 are strips.
  auto rm = layout_permutation(64, 64, TokenLayout::row_major);
  EXPECT_FALSE(groups_are_squares(*rm, 64, 4));
}

TEST(Layout, HilbertStepsToANeighbour) {
  auto perm = layout_permutation(32, 32, TokenLayout::hilbert);
  ASSERT_TRUE(perm.ok());
  for (size_t p = 1; p < perm->size(); ++p) {
    const int dr = std::abs((*perm)[p] / 32 - (*perm)[p - 1] / 32), dc = std::abs((*perm)[p] % 32 - (*perm)[p - 1] % 32);
    ASSERT_EQ(dr + dc, 1) << "step " << p;
  }
}

TEST(Layout, AnySidesArePermutationsWithInverses) {
  for (TokenLayout layout : {TokenLayout::row_major, TokenLayout::z_order, TokenLayout::hilbert}) {
    for (auto [h, w] : {std::pair{1, 1}, std::pair{1, 7}, std::pair{3, 5}, std::pair{37, 23}, std::pair{150, 150},
                        std::pair{17, 113}}) {
      auto perm = layout_permutation(h, w, layout);
      ASSERT_TRUE(perm.ok());
      ASSERT_EQ(perm->size(), size_t(h) * w);
      ASSERT_TRUE(is_permutation(*perm));
      const auto inv = inverse_permutation(*perm);
      for (size_t p = 0; p < perm->size(); ++p) ASSERT_EQ(inv[(*perm)[p]], int32_t(p));
    }
  }
  // Locality survives ragged sides: groups of 16 stay compact (a row-major strip of 16
  // has extent 16; a 4 x 4 square 4).
  for (TokenLayout layout : {TokenLayout::z_order, TokenLayout::hilbert}) {
    auto perm = layout_permutation(150, 150, layout);
    EXPECT_LT(mean_extent(*perm, 150), 6.0) << token_layout_name(layout);
  }
}

TEST(Layout, PermuteTokensRoundTrips) {
  const int64_t h = 13, w = 9, d = 5;
  auto x = llsa_test::randn({2, 3, h * w, d}, 1);
  auto perm = layout_permutation(h, w, TokenLayout::z_order);
  ASSERT_TRUE(perm.ok());
  HostArray y(DType::f32, x.shape()), z(DType::f32, x.shape());
  ASSERT_TRUE(permute_tokens(x.view(), *perm, y.view()).ok());
  EXPECT_EQ(y.ptr<float>()[1 * d + 2], x.ptr<float>()[(*perm)[1] * d + 2]);
  ASSERT_TRUE(permute_tokens(y.view(), inverse_permutation(*perm), z.view()).ok());
  EXPECT_EQ(llsa_test::max_abs_diff(x, z), 0.0);
}

TEST(Layout, Errors) {
  EXPECT_FALSE(layout_permutation(0, 4, TokenLayout::z_order).ok());
  EXPECT_FALSE(layout_permutation(1 << 16, 1 << 16, TokenLayout::z_order).ok());
  auto x = llsa_test::randn({1, 1, 6, 2}, 1);
  HostArray y(DType::f32, x.shape());
  Status s = permute_tokens(x.view(), {0, 1, 2, 3, 4, 4}, y.view());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("perm: not a permutation"), std::string::npos) << s.to_string();
  s = permute_tokens(x.view(), {0, 1, 2}, y.view());
  EXPECT_NE(s.message().find("perm: expected 6 entries"), std::string::npos) << s.to_string();
  EXPECT_FALSE(parse_token_layout("zorder").ok());
}
