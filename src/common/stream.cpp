// src/common/stream.cpp — gmoe::Event and synchronize_stream: the CUDA backend's events and stream
// sync behind a device-agnostic handle (nothing to do on the CPU, where ops finish before returning).
#include "gmoe/stream.h"

#include <utility>

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"

namespace gmoe {

Event::Event(Device device) : device_(device), defined_(true) {
  if (device.is_cuda()) {
    check_cuda_compiled("Event");
    handle_ = cuda_backend::event_create();
  }
}

Event::~Event() {
  if (handle_ != nullptr) cuda_backend::event_destroy(handle_);
}

Event::Event(Event&& other) noexcept
    : device_(other.device_), defined_(std::exchange(other.defined_, false)),
      handle_(std::exchange(other.handle_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) cuda_backend::event_destroy(handle_);
    device_ = other.device_;
    defined_ = std::exchange(other.defined_, false);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void Event::record(Stream stream) {
  GMOE_CHECK(defined_, "Event::record: the event is not defined (made without a device)");
  if (handle_ != nullptr) cuda_backend::event_record(handle_, stream);
}

void Event::wait(Stream stream) const {
  GMOE_CHECK(defined_, "Event::wait: the event is not defined (made without a device)");
  if (handle_ != nullptr) cuda_backend::stream_wait_event(stream, handle_);
}

void synchronize_stream(Stream stream, Device device) {
  if (device.is_cpu()) return;
  check_cuda_compiled("synchronize_stream");
  cuda_backend::stream_synchronize(stream);
}

}  // namespace gmoe
