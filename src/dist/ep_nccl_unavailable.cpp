// src/dist/ep_nccl_unavailable.cpp — the NCCL backend's entry points in a build without it (no CUDA,
// or no NCCL found at configure time): they say so.
#include "dist/ep_backend.h"
#include "gmoe/error.h"

namespace gmoe {

EpUniqueId ep_unique_id() {
  GMOE_FAIL("ep_unique_id: gmoe was built without the NCCL backend (needs CUDA and NCCL at configure time)");
}

std::unique_ptr<EpGroup> make_ep_group_nccl(const EpUniqueId&, int, int, Device, const EpGroupOptions&) {
  GMOE_FAIL("make_ep_group_nccl: gmoe was built without the NCCL backend (needs CUDA and NCCL at configure time)");
}

}  // namespace gmoe
