// src/checkpoint/checkpoint.cpp — a checkpoint as one safetensors file or an index of several.
//
// The index json (Hugging Face's model.safetensors.index.json) is as untrusted as the files: it is
// size-limited, parsed strictly, file names must be plain names (a hostile index must not make us
// open files outside its directory), and the key sets of the index and the files must agree.
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/internal.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe {

using nlohmann::json;
using namespace ckpt_detail;

struct Checkpoint::Impl {
  std::string path;
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<size_t, const SafetensorsEntry*>> where;  // key → file, entry
  std::vector<std::string> keys;
  std::map<std::string, std::string> metadata;
};

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash == 0 ? 1 : slash);
}

json read_index(const std::string& path) {
  struct stat st {};
  GMOE_CHECK(stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), path,
             ": cannot open the index (not a regular file)");
  GMOE_CHECK(static_cast<uint64_t>(st.st_size) <= kMaxSafetensorsHeaderBytes, path,
             ": index is ", st.st_size, " bytes, more than the limit of ",
             kMaxSafetensorsHeaderBytes);
  std::ifstream in(path, std::ios::binary);
  GMOE_CHECK(in.good(), path, ": cannot open the index");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  // {"metadata": {...}, "weight_map": {...}} nests two levels; one more leaves room for fields
  // other writers add, without letting hostile input build deep trees.
  return parse_json_strict(text.data(), text.data() + text.size(), 3, path, "index");
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  std::map<std::string, std::string> weight_map;  // key → file name (index only)
  if (ends_with(path, ".json")) {
    json index = read_index(path);
    GMOE_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               path, ": index must be an object with a \"weight_map\" object");
    if (index.contains("metadata")) {
      GMOE_CHECK(index["metadata"].is_object(), path, ": index \"metadata\" must be an object");
      for (auto it = index["metadata"].begin(); it != index["metadata"].end(); ++it) {
        const json& v = it.value();
        if (v.is_string()) {
          impl->metadata[it.key()] = v.get<std::string>();
        } else if (v.is_number() || v.is_boolean()) {
          impl->metadata[it.key()] = v.dump();
        } else {
          GMOE_FAIL(path, ": index metadata '", it.key(), "' must be a string or a number");
        }
      }
    }
    std::vector<std::string> file_names;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      GMOE_CHECK(it.value().is_string(), path, ": weight_map entry '", it.key(),
                 "' must name a file");
      const std::string f = it.value().get<std::string>();
      GMOE_CHECK(!f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
                     f.find('\\') == std::string::npos && f.find('\0') == std::string::npos,
                 path, ": weight_map entry '", it.key(), "' names '", f,
                 "': file names must be plain names in the index's directory");
      weight_map[it.key()] = f;
      if (std::find(file_names.begin(), file_names.end(), f) == file_names.end()) {
        file_names.push_back(f);
      }
    }
    std::sort(file_names.begin(), file_names.end(), natural_less);
    const std::string dir = dir_of(path);
    for (const std::string& f : file_names) impl->files.push_back(SafetensorsFile::open(dir + "/" + f));
  } else {
    impl->files.push_back(SafetensorsFile::open(path));
    impl->metadata = impl->files[0].metadata();
  }

  for (size_t i = 0; i < impl->files.size(); ++i) {
    const SafetensorsFile& f = impl->files[i];
    const std::string base = f.path().substr(f.path().rfind('/') + 1);
    for (const SafetensorsEntry& e : f.tensors()) {
      if (!weight_map.empty() || impl->files.size() > 1) {
        auto it = weight_map.find(e.name);
        GMOE_CHECK(it != weight_map.end(), path, ": tensor '", e.name, "' of ", f.path(),
                   " is not listed in the index");
        GMOE_CHECK(it->second == base, path, ": tensor '", e.name, "' is in ", f.path(),
                   " but the index places it in ", it->second);
      }
      auto ins = impl->where.emplace(e.name, std::make_pair(i, &e));
      GMOE_CHECK(ins.second, path, ": tensor '", e.name, "' is in two files");
    }
  }
  for (const auto& kv : weight_map) {
    GMOE_CHECK(impl->where.count(kv.first), path, ": index lists tensor '", kv.first, "' in ",
               kv.second, ", which does not hold it");
  }
  for (const auto& kv : impl->where) impl->keys.push_back(kv.first);
  std::sort(impl->keys.begin(), impl->keys.end(), natural_less);
  Checkpoint c;
  c.impl_ = std::move(impl);
  return c;
}

const std::string& Checkpoint::path() const { return impl_->path; }
const std::vector<std::string>& Checkpoint::keys() const { return impl_->keys; }
bool Checkpoint::contains(const std::string& key) const { return impl_->where.count(key) > 0; }

const SafetensorsEntry& Checkpoint::entry(const std::string& key) const {
  auto it = impl_->where.find(key);
  GMOE_CHECK(it != impl_->where.end(), impl_->path, ": no tensor '", key, "'");
  return *it->second.second;
}

const SafetensorsFile& Checkpoint::file_of(const std::string& key) const {
  auto it = impl_->where.find(key);
  GMOE_CHECK(it != impl_->where.end(), impl_->path, ": no tensor '", key, "'");
  return impl_->files[it->second.first];
}

const uint8_t* Checkpoint::bytes(const std::string& key) const {
  return file_of(key).bytes(entry(key));
}

TensorView Checkpoint::view(const std::string& key) const { return file_of(key).view(key); }
const std::vector<SafetensorsFile>& Checkpoint::files() const { return impl_->files; }
const std::map<std::string, std::string>& Checkpoint::metadata() const { return impl_->metadata; }

}  // namespace gmoe
