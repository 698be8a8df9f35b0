// tools/bench/suite.cpp — suite file loading and row scaling.
#include "bench/suite.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "gmoe/error.h"

namespace gmoe::bench {

Suite load_suite(const std::string& path) {
  std::ifstream in(path);
  GMOE_CHECK(in.good(), "suite file '", path, "' cannot be opened");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    GMOE_FAIL("suite file '", path, "' is not valid JSON: ", e.what());
  }
  GMOE_CHECK(j.contains("cases") && j["cases"].is_array(), "suite file '", path,
             "' has no \"cases\" array");
  Suite s;
  s.name = path.substr(path.find_last_of('/') + 1);
  s.name = s.name.substr(0, s.name.find('.'));
  for (const auto& jc : j["cases"]) {
    BenchCase c;
    try {
      c.kind = jc.at("kind").get<std::string>();
      c.name = jc.at("name").get<std::string>();
      c.E = jc.at("E").get<int64_t>();
      if (c.kind == "moe") {
        c.tokens = jc.at("tokens").get<int64_t>();
        c.top_k = jc.at("top_k").get<int64_t>();
        c.rows = c.tokens * c.top_k;
        c.hidden = jc.at("hidden").get<int64_t>();
        c.ffn = jc.at("ffn").get<int64_t>();
        c.activation = jc.value("activation", std::string("swiglu"));
        c.routing = jc.at("routing").get<std::string>();
        c.logit_std = jc.value("logit_std", 1.0);
        c.logit_bias = jc.value("logit_bias", std::vector<double>(static_cast<size_t>(std::max<int64_t>(c.E, 0)), 0.0));
      } else {
        c.rows = jc.at("rows").get<int64_t>();
        c.counts = jc.at("counts").get<std::vector<int64_t>>();
      }
      if (c.kind == "gemm") {
        c.K = jc.at("K").get<int64_t>();
        c.N = jc.at("N").get<int64_t>();
      } else if (c.kind == "mlp") {
        c.hidden = jc.at("hidden").get<int64_t>();
        c.ffn = jc.at("ffn").get<int64_t>();
        c.activation = jc.value("activation", std::string("swiglu"));
      }
    } catch (const nlohmann::json::exception& e) {
      GMOE_FAIL("suite file '", path, "': case ", s.cases.size(), ": ", e.what());
    }
    GMOE_CHECK(c.kind == "gemm" || c.kind == "mlp" || c.kind == "moe", "suite '", path, "' case '", c.name,
               "': unknown kind '", c.kind, "'");
    if (c.kind == "moe") {
      // top_k > E is left to the layer, which names the option (the case becomes skipped rows).
      GMOE_CHECK(c.E >= 1 && c.tokens >= 0 && c.top_k >= 1 && c.hidden >= 1 && c.ffn >= 1, "suite '", path,
                 "' case '", c.name, "': E, top_k, hidden, ffn must be >= 1 and tokens >= 0");
      GMOE_CHECK(static_cast<int64_t>(c.logit_bias.size()) == c.E, "suite '", path, "' case '", c.name, "': ",
                 c.logit_bias.size(), " logit_bias values for E = ", c.E);
      GMOE_CHECK(c.logit_std >= 0, "suite '", path, "' case '", c.name, "': negative logit_std ", c.logit_std);
      s.cases.push_back(std::move(c));
      continue;
    }
    GMOE_CHECK(static_cast<int64_t>(c.counts.size()) == c.E, "suite '", path, "' case '", c.name,
               "': ", c.counts.size(), " counts for E = ", c.E);
    for (int64_t v : c.counts) {
      GMOE_CHECK(v >= 0, "suite '", path, "' case '", c.name, "': negative count ", v);
    }
    const int64_t total = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
    GMOE_CHECK(total == c.rows, "suite '", path, "' case '", c.name, "': counts sum to ", total,
               ", rows is ", c.rows);
    s.cases.push_back(std::move(c));
  }
  return s;
}

BenchCase scale_rows(const BenchCase& c, double factor) {
  if (factor >= 1.0) return c;
  BenchCase s = c;
  const int64_t E = c.E;
  std::vector<double> exact(E);
  std::vector<int64_t> counts(E);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    exact[e] = c.counts[e] * factor;
    counts[e] = c.counts[e] == 0 ? 0 : std::max<int64_t>(1, static_cast<int64_t>(std::floor(exact[e])));
    total += counts[e];
  }
  const int64_t target = std::max<int64_t>(total, static_cast<int64_t>(std::llround(c.rows * factor)));
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return exact[a] - std::floor(exact[a]) > exact[b] - std::floor(exact[b]);
  });
  for (int64_t i = 0; total < target; i = (i + 1) % E) {
    if (c.counts[order[i]] == 0) continue;
    ++counts[order[i]];
    ++total;
  }
  s.counts = counts;
  s.rows = total;
  return s;
}

double gemm_flops(const BenchCase& c) {
  return 2.0 * static_cast<double>(c.rows) * static_cast<double>(c.N) * static_cast<double>(c.K);
}

BenchCase scale_moe_for_cpu(const BenchCase& c, double gflop, double max_weight_bytes) {
  BenchCase s = c;
  const double weights = 2.0 * static_cast<double>(c.E) * 3 * static_cast<double>(c.hidden) * static_cast<double>(c.ffn);
  if (weights > max_weight_bytes) {
    const double f = std::sqrt(max_weight_bytes / weights);
    auto shrink = [f](int64_t n) { return std::max<int64_t>(16, static_cast<int64_t>(std::floor(n * f / 16)) * 16); };
    s.hidden = shrink(c.hidden);
    s.ffn = shrink(c.ffn);
  }
  BenchCase one = s;
  one.rows = s.top_k;  // one token's rows
  const double per_token = mlp_flops(one);
  s.tokens = std::min(c.tokens, std::max<int64_t>(16, static_cast<int64_t>(gflop * 1e9 / per_token)));
  s.rows = s.tokens * s.top_k;
  return s;
}

double mlp_flops(const BenchCase& c) {
  const double rows = static_cast<double>(c.rows), hidden = static_cast<double>(c.hidden);
  const double ffn = static_cast<double>(c.ffn);
  const double fc1_out = c.activation == "squared_relu" ? ffn : 2 * ffn;
  return 2.0 * rows * hidden * fc1_out + 2.0 * rows * ffn * hidden;
}

}  // namespace gmoe::bench
