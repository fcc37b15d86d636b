// Availability messages: a backend that cannot run says why, not compiled in or no device,
// and every entry point that refuses it returns that one status.
#include <gtest/gtest.h>

#include "core/backends.h"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"

using namespace sparsa;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(Backends, HostBackendsAreAlwaysAvailable) {
  EXPECT_TRUE(backend_status(Backend::cpu).ok());
  EXPECT_TRUE(backend_status(Backend::cpu_ref).ok());
}

TEST(Backends, CudaSaysWhetherItIsNotCompiledInOrHasNoDevice) {
  const Status st = backend_status(Backend::cuda);
  EXPECT_EQ(st.ok(), backend_available(Backend::cuda));
  if (!cuda::compiled_in()) {
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::unsupported);
    EXPECT_TRUE(contains(st.message(), "not compiled into this build")) << st.message();
  } else if (cuda::device_count() == 0) {
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(contains(st.message(), "compiled into this build, but no CUDA device is visible")) << st.message();
  } else {
    EXPECT_TRUE(st.ok()) << st.message();
  }
}

TEST(Backends, EntryPointsReturnTheAvailabilityStatus) {
  if (backend_available(Backend::cuda)) GTEST_SKIP() << "a CUDA device is visible";
  const std::string why = backend_status(Backend::cuda).message();
  HostArray q(DType::f32, {1, 1, 4, 64}), out(DType::f32, {1, 1, 4, 64}), lse(DType::f32, {1, 1, 4});
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  EXPECT_EQ(dense(q.view(), q.view(), q.view(), out.view(), lse.view(), opt).message(), why);
}
