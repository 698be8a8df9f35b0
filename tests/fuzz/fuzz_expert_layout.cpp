// tests/fuzz/fuzz_expert_layout.cpp — libFuzzer target for expert-layout detection and conversion.
//
// The input is a safetensors file. It is opened as a checkpoint, its expert parameters detected
// (the first byte picks the detection scope), then converted to both layouts, with a GLU gate/up
// re-ordering when the second byte asks for one. Every step must succeed or throw gmoe::Error;
// anything else (a crash, a sanitizer report, another exception, a leak, a hang) is a finding.
// A conversion that succeeds is checked: the output parses, holds the same expert parameters with
// the same counts, and each expert's bytes are the input's (without GLU re-ordering). Run by
// cmake/fuzz.cmake as the test layout_fuzz; by hand:
//   ./gmoe_fuzz_expert_layout -max_total_time=60 -max_len=65536 CORPUS tests/fuzz/corpus_layout
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace {

// A private directory for the outputs, made once (tmpfs where there is one: no disk traffic).
const std::string& work_dir() {
  static const std::string dir = [] {
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string tmpl = std::string(base) + "/gmoe_fuzz_layout_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) std::abort();
    return std::string(buf.data());
  }();
  return dir;
}

// The input as a file: an anonymous memory file, opened through /proc by path like any other.
std::string input_path(const uint8_t* data, size_t size) {
  static int fd = -1;
  if (fd < 0) fd = memfd_create("gmoe_fuzz_input", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, 0) != 0) std::abort();
  size_t done = 0;
  while (done < size) {
    const ssize_t w = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (w <= 0) std::abort();
    done += static_cast<size_t>(w);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_expert_layout: %s\n", what);
    std::abort();
  }
}

// The converted file must hold the same expert parameters as the input, expert by expert.
void check_output(const gmoe::Checkpoint& in, const std::vector<gmoe::DetectedExpertParam>& params,
                  const std::string& out_path, const gmoe::ExpertDetectOptions& detect, bool glu) {
  const gmoe::Checkpoint out = gmoe::Checkpoint::open(out_path);
  const std::vector<gmoe::DetectedExpertParam> got = gmoe::detect_expert_params(out, detect);
  check(got.size() == params.size(), "the output holds another number of expert parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    const gmoe::ExpertParamInfo& a = params[i].info;
    const gmoe::ExpertParamInfo& b = got[i].info;
    check(got[i].problem.empty(), "the output has a problem the input had not");
    check(a.num_experts == b.num_experts && a.expert_shape == b.expert_shape &&
              a.dtype_code == b.dtype_code,
          "an expert parameter changed its count, shape or dtype");
    if (glu) continue;
    const gmoe::SafetensorsEntry& first =
        in.entry(a.layout == gmoe::ExpertLayout::stacked ? params[i].key.stacked_key()
                                                         : params[i].key.expert_key(0));
    const uint64_t expert_bytes =
        a.layout == gmoe::ExpertLayout::stacked && a.num_experts > 0 ? first.nbytes() / a.num_experts
                                                                     : first.nbytes();
    // At most a few experts: the check must not cost more than the conversion.
    for (int64_t e = 0; e < std::min<int64_t>(a.num_experts, 4) && expert_bytes > 0; ++e) {
      auto bytes_of = [&](const gmoe::Checkpoint& c, const gmoe::ExpertParamInfo& info) {
        return info.layout == gmoe::ExpertLayout::stacked
                   ? c.bytes(params[i].key.stacked_key()) + static_cast<uint64_t>(e) * expert_bytes
                   : c.bytes(params[i].key.expert_key(e));
      };
      check(std::memcmp(bytes_of(in, a), bytes_of(out, b), expert_bytes) == 0,
            "an expert's bytes changed in the conversion");
    }
  }
}

}  // namespace

// Model conventions: recognised or not, never anything but gmoe::Error; a conversion that
// succeeds writes a file recognised as the target convention with the same experts and sizes.
void check_conventions(const gmoe::Checkpoint& in, const std::string& in_path, uint8_t pick, int64_t block) {
  const gmoe::MoeCheckpointInfo rec = gmoe::recognise_moe_checkpoint(in);
  if (!rec.recognised) return;
  int64_t most_experts = 0;
  for (const gmoe::MoeBlock& b : rec.blocks) {
    most_experts = std::max(most_experts, b.num_experts);
    if (b.hidden == 0 || b.ffn == 0) return;  // empty matrices: the shapes cannot tell H from F
  }
  const gmoe::MoeConvention targets[] = {gmoe::MoeConvention::gmoe, gmoe::MoeConvention::megatron,
                                         gmoe::MoeConvention::gpt_oss, gmoe::MoeConvention::mixtral};
  gmoe::MoeConvertOptions opt;
  opt.convention = targets[(pick >> 2) % 4];
  if (pick & 16) opt.glu = gmoe::GluFormat{gmoe::GluLayout::interleaved, block};
  if (pick & 32) opt.layout = gmoe::ExpertLayout::stacked;
  // As above: many per-expert tensors only slow the search.
  if (most_experts > 4096) opt.layout = gmoe::ExpertLayout::stacked;
  const std::string out = work_dir() + "/conv.safetensors";
  try {
    gmoe::convert_moe_checkpoint(in_path, out, opt);
  } catch (const gmoe::Error&) {
    return;
  }
  const gmoe::MoeCheckpointInfo got = gmoe::recognise_moe_checkpoint(gmoe::Checkpoint::open(out));
  check(got.recognised && got.blocks.size() == rec.blocks.size(), "a converted checkpoint is not recognised");
  for (size_t i = 0; i < got.blocks.size(); ++i) {
    const gmoe::MoeBlock &a = rec.blocks[i], &b = got.blocks[i];
    check(a.num_experts == b.num_experts && a.hidden == b.hidden && a.ffn == b.ffn,
          "a converted checkpoint has other experts or sizes");
  }
  unlink(out.c_str());
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  gmoe::ExpertDetectOptions detect;
  if (data[0] & 1) detect.scope_components.clear();  // every key in scope
  if (data[0] & 2) detect.param_names = {"weight", "bias", "w"};
  const bool glu = (data[1] & 1) != 0;
  const int64_t block = 1 + (data[1] >> 1) % 8;
  const std::string in_path = input_path(data + 2, size - 2);
  try {
    const gmoe::Checkpoint in = gmoe::Checkpoint::open(in_path);
    const std::vector<gmoe::DetectedExpertParam> params = gmoe::detect_expert_params(in, detect);
    bool all_valid = true;
    int64_t most_experts = 0;
    for (const gmoe::DetectedExpertParam& d : params) {
      most_experts = std::max(most_experts, d.info.num_experts);
      if (!d.problem.empty()) {
        all_valid = false;
        continue;
      }
      try {
        (void)gmoe::find_expert_param(in, d.key, d.info.num_experts);
      } catch (const gmoe::Error&) {
        check(false, "find_expert_param refused a parameter detect_expert_params found valid");
      }
    }
    for (gmoe::ExpertLayout layout : {gmoe::ExpertLayout::stacked, gmoe::ExpertLayout::per_expert}) {
      // A stacked [E, 0] tensor of a few bytes legitimately becomes E per-expert header entries
      // (the library bounds E by what a header can hold, about a million): work linear in E,
      // seconds under the fuzzer's instrumentation. Past a few thousand it only slows the search.
      if (layout == gmoe::ExpertLayout::per_expert && most_experts > 4096) continue;
      gmoe::ConvertOptions opt;
      opt.detect = detect;
      opt.change_layout = true;
      opt.layout = layout;
      if (glu) {
        opt.glu_stems = {"experts"};
        opt.glu_from = gmoe::GluFormat{gmoe::GluLayout::concatenated, 1};
        opt.glu_to = gmoe::GluFormat{gmoe::GluLayout::interleaved, block};
      }
      const std::string out = work_dir() + "/out.safetensors";
      try {
        gmoe::convert_checkpoint(in_path, out, opt);
      } catch (const gmoe::Error&) {
        continue;  // refused with a message; checked below that a clean input is never refused
      }
      check(all_valid, "convert accepted a checkpoint with an expert-parameter problem");
      check_output(in, params, out, detect, glu);
      unlink(out.c_str());
    }
    check_conventions(in, in_path, data[0], block);
  } catch (const gmoe::Error&) {
    // Rejected with a message: the expected outcome for malformed input.
  }
  return 0;
}
