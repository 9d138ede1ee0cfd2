#include "python/torch_comm.h"

#include <pybind11/stl.h>

#include "reshard/error.h"

namespace py = pybind11;

namespace reshard::python {

TorchCommunicator::TorchCommunicator(py::object impl) : impl_(std::move(impl)) {
  rank_ = impl_.attr("rank").cast<int>();
  size_ = impl_.attr("size").cast<int>();
  name_ = "torch:" + impl_.attr("backend").cast<std::string>();
}

TorchCommunicator::~TorchCommunicator() {
  // The executor may drop its last reference without the GIL; take it to release the object.
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }
}

void TorchCommunicator::rethrow(const char* what, const std::exception& e) const {
  // A collective that raised means a peer died, timed out or disagreed: the job's state, not a bug
  // inside reshard (the MPI communicator reports the same situations as kFailedPrecondition).
  fail(ErrorCode::kFailedPrecondition, "[rank ", rank_, "/", size_, "] ", name_, " ", what, " failed: ", e.what());
}

namespace {
std::vector<int64_t> to_i64(const std::vector<uint64_t>& v) { return std::vector<int64_t>(v.begin(), v.end()); }
}  // namespace

void TorchCommunicator::all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts,
                                     const std::vector<uint64_t>& send_displs, void* recv,
                                     const std::vector<uint64_t>& recv_counts,
                                     const std::vector<uint64_t>& recv_displs) {
  if (int(send_counts.size()) != size_ || int(recv_counts.size()) != size_ || int(send_displs.size()) != size_ ||
      int(recv_displs.size()) != size_)
    fail(ErrorCode::kInternal, "[rank ", rank_, "/", size_, "] all_to_all_v: count vectors must have ", size_, " entries");
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("all_to_all_v")(reinterpret_cast<uintptr_t>(send), to_i64(send_counts), to_i64(send_displs),
                               reinterpret_cast<uintptr_t>(recv), to_i64(recv_counts), to_i64(recv_displs));
  } catch (const py::error_already_set& e) {
    rethrow("all_to_all_v", e);
  }
}

void TorchCommunicator::broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("broadcast")(reinterpret_cast<uintptr_t>(data), int64_t(bytes), root, group);
  } catch (const py::error_already_set& e) {
    rethrow("broadcast", e);
  }
}

int64_t TorchCommunicator::all_reduce_sum(int64_t value) {
  py::gil_scoped_acquire gil;
  try {
    return impl_.attr("all_reduce")(value, "sum").cast<int64_t>();
  } catch (const py::error_already_set& e) {
    rethrow("all_reduce(sum)", e);
  }
}

int64_t TorchCommunicator::all_reduce_max(int64_t value) {
  py::gil_scoped_acquire gil;
  try {
    return impl_.attr("all_reduce")(value, "max").cast<int64_t>();
  } catch (const py::error_already_set& e) {
    rethrow("all_reduce(max)", e);
  }
}

std::vector<std::string> TorchCommunicator::all_gather_strings(const std::string& mine) {
  py::gil_scoped_acquire gil;
  try {
    py::list out = impl_.attr("all_gather_bytes")(py::bytes(mine));
    std::vector<std::string> r;
    r.reserve(out.size());
    for (auto& o : out) r.push_back(o.cast<std::string>());
    if (int(r.size()) != size_)
      fail(ErrorCode::kInternal, "[rank ", rank_, "/", size_, "] all_gather_strings returned ", r.size(), " entries");
    return r;
  } catch (const py::error_already_set& e) {
    rethrow("all_gather_strings", e);
  }
}

void TorchCommunicator::barrier() {
  py::gil_scoped_acquire gil;
  try {
    impl_.attr("barrier")();
  } catch (const py::error_already_set& e) {
    rethrow("barrier", e);
  }
}

void register_torch_comm(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator",
                                                          "A reshard communicator (opaque; see reshard.comm).")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def("all_reduce_sum", [](Communicator& c, int64_t v) { py::gil_scoped_release nogil; return c.all_reduce_sum(v); })
      .def("all_reduce_max", [](Communicator& c, int64_t v) { py::gil_scoped_release nogil; return c.all_reduce_max(v); })
      .def("all_gather_strings",
           [](Communicator& c, const std::string& s) {
             std::vector<std::string> r;
             {
               py::gil_scoped_release nogil;
               r = c.all_gather_strings(s);
             }
             py::list out;
             for (auto& x : r) out.append(py::bytes(x));
             return out;
           })
      .def("barrier", [](Communicator& c) { py::gil_scoped_release nogil; c.barrier(); });
  m.def("local_communicator", []() { return std::shared_ptr<Communicator>(make_local_communicator()); },
        "A communicator of one rank (no torch.distributed needed).");
  m.def("torch_communicator",
        [](py::object impl) { return std::shared_ptr<Communicator>(std::make_shared<TorchCommunicator>(impl)); },
        py::arg("impl"), "Wraps a reshard._comm.ProcessGroupComm as a C++ Communicator.");
}

}  // namespace reshard::python
