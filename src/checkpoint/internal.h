// src/checkpoint/internal.h — pieces shared by the checkpoint sources (not public).
//
// The writer is built around "producers": a tensor's bytes are handed to the file piece by piece,
// so a conversion that stacks or splits experts streams one expert at a time instead of holding
// whole checkpoints in memory.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gmoe/checkpoint.h"

namespace gmoe {
namespace ckpt_detail {

/// Receives a piece of a tensor's bytes.
using ByteSink = std::function<void(const void* data, uint64_t size)>;

/// One tensor to write, whose bytes come from `produce` (which must emit exactly nbytes).
struct RawTensor {
  std::string name;
  std::string dtype_code;  ///< safetensors code ("BF16"); any valid code, gmoe dtype or not
  std::vector<int64_t> shape;
  std::function<void(const ByteSink&)> produce;
};

/// Writes a safetensors file from producers (see save_safetensors for the layout rules), through
/// an AtomicFile with permissions `mode` (-1: those of the file replaced, else the default).
void write_safetensors_raw(const std::string& path, std::vector<RawTensor> tensors,
                           const std::map<std::string, std::string>& metadata,
                           const ProgressFn& progress, int mode = -1);

/// A file that replaces `path` all at once or not at all. Written to a temporary file in the same
/// directory (unnamed where the system allows, so even a killed process leaves nothing behind),
/// fsynced, then renamed over the target; removed if destroyed before commit(). A symlink at
/// `path` is written through (its target replaced, the link kept); a dangling one is refused.
/// Permissions: `mode` when >= 0, else those of the file replaced, else the umask's default.
class AtomicFile {
 public:
  AtomicFile(const std::string& path, int mode = -1);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  /// Appends bytes (buffered).
  void write(const void* p, uint64_t n);
  /// Flushes, fsyncs, renames into place and fsyncs the directory.
  void commit();

 private:
  static constexpr size_t kBuffer = 1 << 20;
  void flush();
  void write_all(const void* p, uint64_t n);
  void discard();
  std::string path_, target_, tmp_;  // tmp_: the temporary file's name, while it has one
  int fd_ = -1;
  int mode_ = -1;
  std::vector<uint8_t> buf_;
};

/// Parses JSON text strictly in one linear pass: no NUL bytes, no duplicate keys in any object, no
/// nesting deeper than `max_depth` containers. Throws gmoe::Error "<source>: <what> ...".
nlohmann::json parse_json_strict(const char* begin, const char* end, int max_depth,
                                 const std::string& source, const char* what);

/// `text` made safe for a terminal: bytes outside printable ASCII (control characters, DEL, and
/// any byte of a multi-byte sequence that is not valid UTF-8 or is a C1 control) become \xNN;
/// a backslash becomes \\.
std::string printable(const std::string& text);

/// Element size of a safetensors dtype code, or 0 when the code is unknown or not byte-sized.
int64_t safetensors_code_size(const std::string& code);

/// Natural order: digit runs compare as numbers ("w2" < "w10").
bool natural_less(const std::string& a, const std::string& b);

/// Emits the bytes of a CPU view of any strides, row-major, in bounded pieces.
void emit_view_bytes(const TensorView& v, const ByteSink& sink);

/// "[2, 3]".
std::string shape_string(const std::vector<int64_t>& shape);

/// Shape of a view as a vector.
std::vector<int64_t> view_shape(const TensorView& v);

/// A contiguous CPU view over `data` with a runtime shape (rank <= TensorView::kMaxDims).
TensorView make_view(const void* data, DType dtype, const std::vector<int64_t>& shape);

/// The expert index of `key` when it is `p.stem<e>p.suffix` with e written canonically (no sign,
/// no leading zeros, at most 18 digits); -1 otherwise.
int64_t per_expert_index(const std::string& key, const ExpertParamKey& p);

/// Checks an expert parameter found in `ckpt` (stacked key present or not, per-expert keys by
/// index) and fills `info`; returns the problem in words, or "" when consistent. With
/// num_experts >= 0 the count must be exactly that.
std::string check_param(const Checkpoint& ckpt, const ExpertParamKey& p, bool stacked_present,
                        const std::map<int64_t, std::string>& experts, int64_t num_experts,
                        ExpertParamInfo* info);

/// Position of row j of half h (0 gate, 1 up) among the 2F rows of gate/up layout f.
inline int64_t glu_row(const GluFormat& f, int64_t h, int64_t j, int64_t F) {
  if (f.layout == GluLayout::concatenated) return h * F + j;
  const int64_t b = f.block;
  return (j / b) * 2 * b + h * b + j % b;
}

/// Refuses `out` when it is the checkpoint `in` itself or one of its files (same file after
/// following links), unless `allow`: a conversion reads its input while writing.
void check_output_not_input(const Checkpoint& ckpt, const std::string& out, bool allow);

/// Writes a conversion's output (write_safetensors_raw) with the permissions of the input's
/// first file: the output is a version of the input.
void write_like_input(const Checkpoint& ckpt, const std::string& out, std::vector<RawTensor> tensors,
                      const std::map<std::string, std::string>& metadata, const ProgressFn& progress);

/// The metadata a conversion keeps: the single file's "__metadata__" (none from an index).
std::map<std::string, std::string> input_metadata(const Checkpoint& ckpt);

/// Joins strings with a separator, eliding the middle when there are more than `max_items`.
std::string join_limited(const std::vector<std::string>& items, size_t max_items = 20);

}  // namespace ckpt_detail
}  // namespace gmoe
