// Host and device copies of one [batch, heads, len, d] test input, for the selector tests that
// compare a cuda path with the CPU's on the same values (only with the CUDA backend).
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/attention_params.h"
#include "sparsa/tensor.h"

namespace sparsa_test {

struct DeviceInput {
  sparsa::HostArray host;       // the dtype, rows padded by seq_pad elements
  sparsa::Tensor host_view;     // strided view of host ([batch, heads, len, d])
  sparsa::DeviceArray device;   // the same bytes on cuda:0
  sparsa::Tensor device_view;
};

// `values` f32 [batch, heads, len, d], stored in `dtype` with seq_pad elements of padding after
// every token row (strided views), on the host and on cuda:0.
inline DeviceInput device_input(const sparsa::HostArray& values, sparsa::DType dtype, int64_t seq_pad) {
  using namespace sparsa;
  const auto& s = values.shape();
  const int64_t d = s[3], row = d + seq_pad, rows = s[0] * s[1] * s[2];
  DeviceInput in;
  in.host = HostArray(dtype, {s[0], s[1], s[2], row});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < d; ++t) detail::store_element(in.host.data(), dtype, r * row + t, values.ptr<float>()[r * d + t]);
  }
  in.host_view = in.host.view();
  in.host_view.shape[3] = d;
  auto dev = DeviceArray::allocate(dtype, {s[0], s[1], s[2], row}, {DeviceType::cuda, 0});
  EXPECT_TRUE(dev.ok()) << dev.status().to_string();
  in.device = std::move(dev).value();
  EXPECT_EQ(cudaMemcpy(in.device.data(), in.host.data(), in.host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  // From pageable memory cudaMemcpy returns with the last DMA possibly in flight, on the legacy
  // stream, which the tests' non-blocking streams do not wait for: finished here.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  in.device_view = in.device.view();
  in.device_view.shape[3] = d;
  return in;
}

}  // namespace sparsa_test
