// A reshard::Communicator over a torch.distributed process group (gloo on CPU, NCCL on GPUs).
//
// The collectives are carried out by a Python object (reshard._comm.ProcessGroupComm) that wraps
// this rank's memory in uint8 tensors and calls torch.distributed. The executor calls the methods
// from the thread that called reshard.load/save, with the GIL released around the C++ work; each
// method takes the GIL back for the duration of the callback. Errors raised by torch.distributed
// become reshard::Error(kInternal) prefixed with "[rank r/world]" and keep torch's message.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "reshard/comm.h"

namespace reshard::python {

class TorchCommunicator final : public Communicator {
 public:
  /// `impl` is a reshard._comm.ProcessGroupComm (rank, size, backend attributes and the
  /// collective methods). Call with the GIL held.
  explicit TorchCommunicator(pybind11::object impl);
  ~TorchCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  void all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts,
                    const std::vector<uint64_t>& send_displs, void* recv,
                    const std::vector<uint64_t>& recv_counts,
                    const std::vector<uint64_t>& recv_displs) override;
  void broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) override;
  int64_t all_reduce_sum(int64_t value) override;
  int64_t all_reduce_max(int64_t value) override;
  std::vector<std::string> all_gather_strings(const std::string& mine) override;
  void barrier() override;

  pybind11::object impl() const { return impl_; }

 private:
  [[noreturn]] void rethrow(const char* what, const std::exception& e) const;
  pybind11::object impl_;
  int rank_ = 0, size_ = 1;
  std::string name_;
};

/// Registers the communicator class on the extension module.
void register_torch_comm(pybind11::module_& m);

}  // namespace reshard::python
