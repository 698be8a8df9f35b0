// gmoe/checkpoint.h — safetensors checkpoints with expert weights in either layout.
//
// Three levels, each usable alone:
//
//  1. safetensors files: a validating, memory-mapped reader (SafetensorsFile), a writer
//     (save_safetensors), and a file set (Checkpoint: one file, or an HF-style index json that maps
//     each key to one of several files). Files are untrusted: every header is checked before any
//     tensor byte is touched, and every problem is a gmoe::Error naming the file, the tensor and what
//     is wrong — never a crash, never a read outside the file.
//
//  2. expert parameters: a parameter of E experts is stored either as one stacked tensor
//     `<stem><suffix>` of shape [E, ...] or as E per-expert tensors `<stem><e><suffix>`, e.g.
//     `layers.0.experts.fc1.weight` [E, out, in] vs `layers.0.experts.fc1.weight3` [out, in].
//     The key mapping (ExpertParamKey) is a pure function over names, so master weights and optimizer
//     moments follow exactly the mapping of their weight. Loading checks the layout strictly: missing
//     experts, gaps in the indexed set, both layouts at once, a shape that is the transpose of the
//     expected [out, in], a dtype other than the destination's — each an error naming the keys.
//     FC1 weights of gated activations can be converted between concatenated ([gate; up]) and
//     interleaved (blocks of `block` rows, alternating gate and up) gate/up layouts on the way.
//
//  3. expert parallelism: a rank loads experts [first, first + E_local) from a checkpoint holding all
//     experts, in either layout; save_expert_shards writes a rank's experts so that the files of all
//     ranks together are byte for byte the file set a single process writes (see there).
//
//  4. model conventions: the MoE blocks of Hugging Face (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek,
//     gpt-oss), Megatron-Core and gmoe checkpoints found from key names and shapes alone
//     (recognise_moe_checkpoint), and rewritten in another naming, layout, gate/up form,
//     orientation or dtype (convert_moe_checkpoint); docs/checkpoints.md lists them.
//
// Everything here is CPU-side: tensor views passed in or out must be on the CPU.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gmoe/activation.h"  // GluLayout, GluFormat
#include "gmoe/dtype.h"
#include "gmoe/grouped.h"
#include "gmoe/tensor.h"

namespace gmoe {

// ------------------------------------------------------------------------------------------------
// safetensors files
// ------------------------------------------------------------------------------------------------

/// Largest JSON header accepted (the limit of the reference implementation): a longer one is
/// treated as corrupt or hostile rather than parsed.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// The safetensors dtype code of a gmoe dtype: "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2",
/// "F8_E8M0", "I32", "I64".
const char* safetensors_dtype_code(DType t);

/// One validated tensor entry of a safetensors header.
struct SafetensorsEntry {
  std::string name;            ///< the key
  std::string dtype_code;      ///< as written in the file ("BF16")
  bool has_gmoe_dtype = false; ///< false for valid safetensors dtypes gmoe has no DType for (BOOL, U8, F64, ...)
  DType dtype = DType::f32;    ///< meaningful only when has_gmoe_dtype
  int64_t element_size = 0;    ///< bytes per element
  std::vector<int64_t> shape;  ///< any rank, 0-d included
  uint64_t begin = 0;          ///< byte range [begin, end) relative to the start of the data section
  uint64_t end = 0;

  /// Product of the shape (1 for a 0-d tensor).
  int64_t numel() const;
  /// end - begin, equal to numel() * element_size in a validated entry.
  uint64_t nbytes() const { return end - begin; }
};

/// A parsed and validated safetensors header.
struct SafetensorsHeader {
  uint64_t header_bytes = 0;                   ///< N, the length of the JSON header
  uint64_t data_offset = 0;                    ///< 8 + N: where the data section starts in the file
  uint64_t data_bytes = 0;                     ///< bytes from data_offset to the end of the buffer
  std::vector<SafetensorsEntry> tensors;       ///< in natural key order ("w2" before "w10")
  std::map<std::string, std::string> metadata; ///< the "__metadata__" object (string → string)

  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
};

/// Parses and validates a whole safetensors buffer of `size` bytes (the file contents): the 8-byte
/// little-endian header length (at most kMaxSafetensorsHeaderBytes, not past the end), the JSON
/// (an object; no duplicate keys; UTF-8), dtype codes, shapes (non-negative integers, no overflow),
/// data_offsets (begin <= end <= data section size; end - begin == numel × element size), and that
/// no two non-empty tensors overlap. Gaps between tensors are allowed (the format does not need
/// them closed to be read safely). `source` names the buffer (the file path) in errors.
/// Reads nothing outside [data, data + size).
SafetensorsHeader parse_safetensors(const void* data, uint64_t size, const std::string& source);

/// A read-only, memory-mapped safetensors file, validated when opened. Copies share the mapping,
/// which lives until the last copy is gone. Tensor bytes are paged in only when read, so slicing a
/// few experts out of a large file reads only those. (If another process truncates the file while
/// it is mapped, the OS raises SIGBUS: checkpoints must not be rewritten in place while read.)
class SafetensorsFile {
 public:
  /// Maps and validates `path`; throws gmoe::Error naming the file on any problem.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const;
  const SafetensorsHeader& header() const;
  const std::vector<SafetensorsEntry>& tensors() const { return header().tensors; }
  const std::map<std::string, std::string>& metadata() const { return header().metadata; }
  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const { return header().find(name); }
  /// The entry named `name`; throws naming the file and the key when absent.
  const SafetensorsEntry& entry(const std::string& name) const;
  /// First byte of a tensor's data (may be unaligned if the writer did not align; copy with memcpy).
  const uint8_t* bytes(const SafetensorsEntry& e) const;
  /// A read-only CPU view of a tensor (do not write through it), valid while this file or a copy
  /// of it lives (the view does not own the mapping). Throws for dtypes gmoe has no DType for and
  /// for ranks above TensorView::kMaxDims.
  TensorView view(const std::string& name) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

/// One tensor to write: a CPU view with any strides.
struct NamedTensor {
  std::string name;  ///< the key; valid UTF-8, not "__metadata__"
  TensorView view;
};

/// Called while writing: bytes of tensor data written so far, the total, and the current key.
using ProgressFn = std::function<void(uint64_t done, uint64_t total, const std::string& key)>;

/// Writes a safetensors file. As Python's safetensors does, tensors are laid out by descending
/// element size, then by key (natural order), with no gaps, and the header is padded with spaces to
/// a multiple of 8 — so every tensor starts aligned to its element size, and the output is
/// deterministic (the same tensors and metadata always give the same bytes). Written to a temporary
/// file in the same directory and renamed, so a crash never leaves a half-written checkpoint under
/// `path`. Duplicate keys are an error.
void save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      const ProgressFn& progress = nullptr);

/// A checkpoint: one safetensors file, or a set of files listed by an index json in the format of
/// Hugging Face's `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {key: file}},
/// files relative to the index's directory). Open either path. The index is checked strictly: every
/// key must be in the file it names, every key of every listed file must be listed, file names
/// must be plain names (no directories).
class Checkpoint {
 public:
  /// Opens a `.safetensors` file, or an index when the path ends in `.json`.
  static Checkpoint open(const std::string& path);

  /// The path given to open().
  const std::string& path() const;
  /// Every key, in natural order.
  const std::vector<std::string>& keys() const;
  bool contains(const std::string& key) const;
  /// The entry of `key`; throws naming the checkpoint and the key when absent.
  const SafetensorsEntry& entry(const std::string& key) const;
  /// The file holding `key`.
  const SafetensorsFile& file_of(const std::string& key) const;
  /// First byte of the data of `key`.
  const uint8_t* bytes(const std::string& key) const;
  /// A read-only CPU view of `key`, valid while this checkpoint or a copy of it lives.
  TensorView view(const std::string& key) const;
  /// The files, in the order of the index (one for a single file).
  const std::vector<SafetensorsFile>& files() const;
  /// Metadata: the single file's "__metadata__", or an index's "metadata" values as text.
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// ------------------------------------------------------------------------------------------------
// expert parameters
// ------------------------------------------------------------------------------------------------

/// How expert parameters are stored.
enum class ExpertLayout : uint8_t {
  stacked,     ///< one tensor `<stem><suffix>` of shape [E, ...expert shape]
  per_expert,  ///< E tensors `<stem><e><suffix>`, e = 0 … E-1 written in decimal without padding
};

/// "stacked" or "per-expert".
const char* expert_layout_name(ExpertLayout layout);

/// Names one per-parameter state of an expert parameter in both layouts. The weight itself has an
/// empty suffix; any other state (fp32 master weight, Adam moments) is the same stem with a
/// prefix or suffix added by with_state(), so every state follows the weight's layout mapping.
/// Example: stem "layers.0.experts.fc1.weight": stacked key "layers.0.experts.fc1.weight",
/// expert 3 "layers.0.experts.fc1.weight3"; with_state("", ".exp_avg") gives
/// "layers.0.experts.fc1.weight.exp_avg" and "layers.0.experts.fc1.weight3.exp_avg".
struct ExpertParamKey {
  std::string stem;    ///< everything up to and including the parameter name
  std::string suffix;  ///< after the expert index ("" or ".exp_avg", ...)

  /// The key of the stacked tensor. Where the expert index is a key component of its own
  /// (stem "m.experts.", suffix ".w1.weight": expert key "m.experts.3.w1.weight"), the stacked key
  /// drops that component and its dot ("m.experts.w1.weight"), never leaving an empty component.
  std::string stacked_key() const {
    if (!stem.empty() && stem.back() == '.' && !suffix.empty() && suffix.front() == '.') {
      return stem + suffix.substr(1);
    }
    return stem + suffix;
  }
  /// The key of expert `e`'s tensor in the per-expert layout.
  std::string expert_key(int64_t e) const { return stem + std::to_string(e) + suffix; }
  /// The key of another state of the same parameter: `prefix` goes before the stem, `suffix` after
  /// the current suffix.
  ExpertParamKey with_state(const std::string& prefix, const std::string& suffix_add) const {
    return ExpertParamKey{prefix + stem, suffix + suffix_add};
  }
};

/// What a checkpoint holds for one expert parameter.
struct ExpertParamInfo {
  ExpertLayout layout = ExpertLayout::stacked;
  int64_t num_experts = 0;           ///< shape[0] (stacked) or the number of per-expert tensors
  std::vector<int64_t> expert_shape; ///< the shape of one expert ([out, in] for a weight)
  std::string dtype_code;            ///< safetensors dtype code
};

/// Finds `key` in `ckpt` and checks it: present in exactly one layout; a per-expert set is
/// complete (indices 0 … E-1, the missing keys listed otherwise) with one shape and dtype;
/// a stacked tensor has rank >= 1. With num_experts >= 0, the checkpoint must hold exactly that
/// many experts (an index past it is an error too). Throws gmoe::Error naming the keys.
ExpertParamInfo find_expert_param(const Checkpoint& ckpt, const ExpertParamKey& key,
                                  int64_t num_experts = -1);

/// Parses "concat" / "concatenated" / "interleaved:B" (B a positive integer; "interleaved" alone
/// means B = 1).
GluFormat glu_format_from_string(const std::string& text);
/// The inverse of glu_format_from_string ("concatenated", "interleaved:8").
std::string glu_format_name(const GluFormat& f);

/// Copies `src` into `dst` (CPU, contiguous, same dtype and shape, not overlapping) re-ordering the
/// 2F entries along dimension `axis` from gate/up layout `from` to layout `to`. Works for any dtype
/// (it moves bytes): weights ([2F, in], axis 0; or stacked [E, 2F, in], axis 1), biases, moments.
void convert_glu(const TensorView& src, const GluFormat& from, const TensorView& dst,
                 const GluFormat& to, int axis);

/// One expert parameter (or state) to load into memory.
struct ExpertParamToLoad {
  ExpertParamKey key;
  /// Where to put experts [first, first + E_local): `dst.stacked` of shape [E_local, ...] or
  /// `dst.list` of E_local views; any rank (a bias is [E_local, out] or a list of [out]); each
  /// expert's view contiguous, on the CPU; dtype equal to the checkpoint's (no silent casts).
  ExpertWeights dst;
  /// When true, the first dimension of each expert tensor is a GLU gate/up dimension stored in
  /// `checkpoint_glu` and wanted in `model_glu`.
  bool glu = false;
  GluFormat checkpoint_glu;
  GluFormat model_glu;
};

/// Loads one expert parameter: experts [first, first + E_local) of a checkpoint that holds
/// `num_experts` experts, in either layout, into `p.dst` in either layout. Checks with
/// find_expert_param, then dtype, and the per-expert shape against the destination's: a shape that
/// is the transpose of the expected one is an error naming the key (gmoe stores weights [out, in]).
void load_expert_param(const Checkpoint& ckpt, const ExpertParamToLoad& p, int64_t num_experts,
                       int64_t first = 0);

/// Keys of `ckpt` that are none of the stacked or per-expert (0 … num_experts-1) keys of `params`.
std::vector<std::string> find_unexpected_keys(const Checkpoint& ckpt,
                                              const std::vector<ExpertParamKey>& params,
                                              int64_t num_experts);

/// Loads every parameter (load_expert_param), then looks for keys no parameter claimed: an error
/// listing them unless `allow_unexpected`, in which case they are returned so the caller can report
/// them.
std::vector<std::string> load_expert_params(const Checkpoint& ckpt,
                                            const std::vector<ExpertParamToLoad>& params,
                                            int64_t num_experts, int64_t first = 0,
                                            bool allow_unexpected = false);

/// One expert parameter (or state) to save.
struct ExpertParamToSave {
  ExpertParamKey key;
  /// The experts held in memory (all of them, or a rank's slice), either layout, CPU.
  ExpertWeights src;
  /// When true, the first dimension of each expert tensor is GLU gate/up, held in `model_glu` and
  /// written in `checkpoint_glu`.
  bool glu = false;
  GluFormat model_glu;
  GluFormat checkpoint_glu;
};

/// Saves all experts of `params` (src must hold every expert: E_local == E) in `layout`, plus
/// `extra` tensors (non-expert parameters), to one safetensors file.
void save_expert_params(const std::string& path, const std::vector<ExpertParamToSave>& params,
                        ExpertLayout layout, const std::map<std::string, std::string>& metadata = {},
                        const std::vector<NamedTensor>& extra = {},
                        const ProgressFn& progress = nullptr);

/// Options of save_expert_shards.
struct ExpertShardOptions {
  /// Experts per file (G). Must divide num_experts, and each rank's first and E_local.
  int64_t experts_per_file = 1;
  /// Write the index json. Its content depends only on the parameter keys, shapes, dtypes and
  /// num_experts, so any one rank (say rank 0) writes it without communication.
  bool write_index = true;
  /// Written into every shard's "__metadata__" (the same on every rank, so shards stay identical).
  std::map<std::string, std::string> metadata;
};

/// The expert-parallel save. The checkpoint is a file set in Hugging Face's sharded format:
/// `<dir>/<name>-<k>-of-<n>.safetensors` (k = 1 … n, 5 digits, n = num_experts / G) holding experts
/// [(k-1)·G, k·G) of every parameter in the per-expert layout with global expert indices, and
/// `<dir>/<name>.safetensors.index.json` mapping every key to its file, with
/// metadata.total_size. A file depends only on its experts, never on the rank count, so the files
/// written by ranks holding [first, first + E_local) for any partition into multiples of G are
/// byte for byte those of a single-process save (first = 0, E_local = num_experts). Load it back
/// with Checkpoint::open(index path) into any layout and any expert-parallel size, or turn it into
/// one stacked file with `gmoe-ckpt convert`.
void save_expert_shards(const std::string& dir, const std::string& name,
                        const std::vector<ExpertParamToSave>& params, int64_t first,
                        int64_t num_experts, const ExpertShardOptions& options = {});

/// The index path save_expert_shards writes: `<dir>/<name>.safetensors.index.json`.
std::string expert_shard_index_path(const std::string& dir, const std::string& name);

// ------------------------------------------------------------------------------------------------
// discovery and conversion (gmoe-ckpt)
// ------------------------------------------------------------------------------------------------

/// Which keys are expert parameters when none are named explicitly.
struct ExpertDetectOptions {
  /// A key is in scope when one of its dot-separated components is in this list (an empty list:
  /// every key is in scope).
  std::vector<std::string> scope_components = {"experts"};
  /// Parameter names: an in-scope key whose component is `<name>` (stacked) or `<name><e>`
  /// (per-expert) is an expert parameter; the last such component counts.
  std::vector<std::string> param_names = {"weight", "bias"};
};

/// An expert parameter found by detect_expert_params.
struct DetectedExpertParam {
  ExpertParamKey key;
  ExpertParamInfo info;          ///< meaningful when problem is empty
  std::vector<std::string> keys; ///< the checkpoint keys that belong to it
  std::string problem;           ///< empty, or what is wrong (both layouts, missing experts, ...)
};

/// Groups the keys of `ckpt` into expert parameters (see ExpertDetectOptions), in natural order of
/// their stems. Never throws for an inconsistent group: `problem` says what is wrong.
std::vector<DetectedExpertParam> detect_expert_params(const Checkpoint& ckpt,
                                                      const ExpertDetectOptions& options = {});

/// Options of convert_checkpoint.
struct ConvertOptions {
  ExpertDetectOptions detect;
  /// Target layout for every expert parameter; when unset each keeps its own.
  bool change_layout = false;
  ExpertLayout layout = ExpertLayout::stacked;
  /// Expected number of experts; -1: every expert parameter must agree on one count.
  int64_t num_experts = -1;
  /// GLU gate/up conversion of expert parameters whose stem contains one of these substrings
  /// (e.g. "fc1", "gate_up_proj"); empty: no GLU conversion.
  std::vector<std::string> glu_stems;
  GluFormat glu_from;
  GluFormat glu_to;
  /// The dimension of each expert tensor that holds gate/up; -1: dimension 0, except for an FC1
  /// weight that recognise_moe_checkpoint finds stored [in, out] (gpt-oss), whose gate/up
  /// dimension is the last one.
  int glu_axis = -1;
  /// Writing onto the input (its path, or one of its files) is refused unless this is set; it is
  /// then still done through a temporary file renamed over it.
  bool allow_overwrite_input = false;
  /// Plan only: return the plan, write nothing.
  bool dry_run = false;
  ProgressFn progress;
};

/// One tensor (or per-expert set) a conversion writes, and where it comes from.
struct ConvertPlanEntry {
  std::string key;              ///< the key, or "<stem>{0..E-1}<suffix>" for a per-expert set
  std::string dtype_code;       ///< as written
  std::vector<int64_t> shape;   ///< of the tensor (of one expert for a per-expert set)
  std::string source;           ///< in words: the keys read and what is done to them
};

/// Rewrites checkpoint `in` (file or index) as one safetensors file `out`: expert parameters in the
/// requested layout and gate/up layout, every other tensor copied byte for byte, metadata kept.
/// Streams expert by expert, so memory stays at one expert tensor. Throws (before writing anything)
/// when any expert parameter has a problem. Returns the plan: one entry per tensor written (per
/// expert parameter in the per-expert layout).
std::vector<ConvertPlanEntry> convert_checkpoint(const std::string& in, const std::string& out,
                                                 const ConvertOptions& options);

// ------------------------------------------------------------------------------------------------
// model conventions: Hugging Face, Megatron-Core, gmoe (gmoe-ckpt's default)
// ------------------------------------------------------------------------------------------------

/// A family of checkpoint key names and layouts for the expert MLPs of an MoE block. Each names
/// where a block's experts live (`<layer>.<module>.experts.`), the key of each expert tensor, and
/// how the tensors are stored by default (see docs/checkpoints.md for the table):
enum class MoeConvention : uint8_t {
  gmoe,      ///< gmoe's GroupedMLP state_dict: `fc1.weight` [E, 2F, H] (or `fc1.weight<e>`), `fc2.weight`, biases
  mixtral,   ///< HF Mixtral: `block_sparse_moe.experts.<e>.w1/w3/w2.weight` [out, in], router `block_sparse_moe.gate`
  qwen,      ///< HF Qwen2-MoE / Qwen3-MoE / OLMoE: `mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`, router `mlp.gate`, `mlp.shared_expert.*` + `mlp.shared_expert_gate`
  deepseek,  ///< HF DeepSeek-V2/V3: as qwen, with `mlp.shared_experts.*` and `mlp.gate.e_score_correction_bias`
  gpt_oss,   ///< HF gpt-oss: stacked `mlp.experts.gate_up_proj` [E, H, 2F] ([in, out], gate/up interleaved by 1 along the last dim), `gate_up_proj_bias`, `down_proj` [E, F, H], `down_proj_bias`, router `mlp.router`
  megatron,  ///< Megatron-Core with TE grouped linear: `decoder.layers.<L>.mlp.experts.linear_fc1.weight<e>` [2F, H] ([gate; up]), `linear_fc2.weight<e>`; stacked `linear_fc1.weight` [E, 2F, H] is the single grouped weight form; router `mlp.router.weight` / `expert_bias`
};

/// "gmoe", "mixtral", "qwen", "deepseek", "gpt-oss", "megatron".
const char* moe_convention_name(MoeConvention c);
/// Parses a convention name (also "olmoe", "qwen2-moe", "qwen3-moe", "deepseek-v3", "gpt_oss",
/// "mcore"); throws naming the accepted ones.
MoeConvention moe_convention_from_string(const std::string& text);

/// How an expert weight matrix is stored: [out, in] as nn.Linear and gmoe, or [in, out] (gpt-oss).
enum class WeightOrientation : uint8_t {
  out_in,  ///< [out, in]
  in_out,  ///< [in, out]: the transpose
};

/// "[out, in]" or "[in, out]".
const char* weight_orientation_name(WeightOrientation o);

/// What an expert tensor of an MoE block is.
enum class MoeTensorRole : uint8_t {
  fc1,        ///< gate and up in one weight (or the FC1 of a non-gated MLP, `up_proj` under Hugging Face names)
  gate,       ///< the gate projection alone (w1, gate_proj)
  up,         ///< the up projection alone (w3, up_proj)
  fc2,        ///< the down projection (w2, down_proj, linear_fc2)
  fc1_bias,   ///< fc1's bias, gate/up like fc1
  gate_bias,  ///< gate's bias
  up_bias,    ///< up's bias
  fc2_bias,   ///< fc2's bias
};

/// "fc1", "gate", "up", "fc2", "fc1_bias", "gate_bias", "up_bias", "fc2_bias".
const char* moe_tensor_role_name(MoeTensorRole r);

/// One expert tensor of an MoE block as found in a checkpoint.
struct MoeExpertTensor {
  MoeTensorRole role = MoeTensorRole::fc1;
  ExpertParamKey key;                     ///< stacked_key() / expert_key(e)
  ExpertParamInfo info;                   ///< layout, E, one expert's shape, dtype
  WeightOrientation orientation = WeightOrientation::out_in;  ///< weights only
  GluFormat glu;                          ///< fc1 and fc1_bias of a gated MLP: gate/up layout
  std::vector<std::string> keys;          ///< the checkpoint keys that hold it
};

/// One MoE block (one layer's experts) as found in a checkpoint.
struct MoeBlock {
  std::string module;        ///< key prefix of the block ("model.layers.3.block_sparse_moe.")
  std::string experts;       ///< key prefix of its experts ("model.layers.3.block_sparse_moe.experts.")
  std::string layer_prefix;  ///< key prefix up to the layer index ("model.layers.3."), "" if none
  int64_t layer = -1;        ///< the layer index found in the keys, -1 if none
  int64_t num_experts = 0;   ///< E
  int64_t hidden = 0;        ///< H
  int64_t ffn = 0;           ///< F (per expert)
  bool gated = true;         ///< FC1 has 2F outputs (gate and up), else F
  bool separate_gate_up = false;  ///< gate and up stored as two tensors
  std::vector<MoeExpertTensor> tensors;  ///< the expert tensors, in role order
  /// Router tensors beside the experts: "router.weight" [E, H], "router.bias" [E],
  /// "score_correction_bias" [E] → key.
  std::map<std::string, std::string> router;
  /// Shared-expert tensors (always computed, not routed): role ("gate", "up", "fc1", "fc2",
  /// "gate_weight" (the shared expert's sigmoid gate)) → key.
  std::map<std::string, std::string> shared;
};

/// What recognise_moe_checkpoint found.
struct MoeCheckpointInfo {
  bool recognised = false;            ///< at least one consistent MoE block of one convention
  MoeConvention convention = MoeConvention::gmoe;
  std::string family;                 ///< the model family in words ("Qwen2-MoE", "Mixtral", ...)
  std::vector<MoeBlock> blocks;       ///< in layer order
  std::vector<std::string> problems;  ///< what stopped a block from being recognised, in words
};

/// Finds the MoE blocks of a checkpoint from its key names and shapes alone: the convention,
/// the layers, the experts (per-expert or stacked), each tensor's orientation (from the shapes
/// where they decide, else the convention's) and GLU form (separate, or fused: interleaved:1 for
/// gpt-oss, concatenated for the others, as their models compute it, or the layout named in the
/// metadata entry "gmoe.fc1_glu" that convert_moe_checkpoint writes; `fused_glu` overrides both,
/// for files whose keys do not tell, e.g. a gmoe or Megatron checkpoint saved interleaved).
/// Never throws for an inconsistent block: `problems` says what is wrong.
MoeCheckpointInfo recognise_moe_checkpoint(const Checkpoint& ckpt,
                                           const GluFormat* fused_glu = nullptr);

/// Options of convert_moe_checkpoint. Every unset field keeps what the source has when the
/// convention is kept, and takes the target convention's default when it changes.
struct MoeConvertOptions {
  std::optional<MoeConvention> convention;     ///< key naming to write
  std::optional<ExpertLayout> layout;          ///< stacked or per-expert
  std::optional<bool> separate_gate_up;        ///< two tensors, or one FC1
  std::optional<GluFormat> glu;                ///< gate/up layout of a fused FC1 written
  std::optional<WeightOrientation> orientation;  ///< of every expert weight written
  std::optional<GluFormat> glu_from;           ///< gate/up layout of a fused FC1 read (see recognise_moe_checkpoint)
  std::optional<DType> cast;                   ///< cast every f32/bf16/f16 tensor (none: bit-exact)
  bool allow_overwrite_input = false;          ///< see ConvertOptions
  bool dry_run = false;                        ///< plan only, write nothing
  ProgressFn progress;                         ///< as for save_safetensors
};

/// Rewrites checkpoint `in` (file or index) as one safetensors file `out` in another convention,
/// layout, gate/up form, orientation or dtype (recognise_moe_checkpoint finds the source; an
/// unrecognised checkpoint is an error naming what was missing). Router tensors are renamed with
/// their block; shared experts are renamed (and their gate/up fused or split for megatron); every
/// other tensor is copied byte for byte under its own name. Values are moved, never recomputed:
/// bit-exact unless `cast`. Streams one expert at a time. Returns the plan (with dry_run, only the
/// plan). A fused FC1 written in a gate/up layout other than the convention's is named in the
/// metadata ("gmoe.fc1_glu" = "interleaved:8"). Throws before writing anything when a block has a
/// problem or the target cannot hold
/// what the source has (a bias in a convention without bias keys, separate gate/up in gpt-oss
/// naming, ...).
std::vector<ConvertPlanEntry> convert_moe_checkpoint(const std::string& in, const std::string& out,
                                                     const MoeConvertOptions& options);

}  // namespace gmoe
