#pragma once
// Op names, op keys and the declarative selective-checkpoint policy (SPEC 2).
//
// OpNames interns op names ("aten.mm.default") into small dense integer keys, once per
// process, so the per-op hot path of a checkpoint region passes an int64 instead of a
// string or a Python object. The Python layer maps each OpOverload to its key once
// (a dict lookup afterwards).
//
// OpPolicyTable is a policy written as data: op name -> CheckpointPolicy, plus a default.
// A name is either
//   * an overload, "ns.op.overload" (e.g. "aten.mm.default"): exactly that overload, or
//   * a packet, "ns.op" (e.g. "aten.mm"): every overload of the op ("aten.mm.default",
//     "aten.mm.out", ...).
// torch's schema spelling "ns::op" / "ns::op.overload" is accepted and normalised.
// An overload entry wins over a packet entry; ops in neither get the default.
// policy_for(key) is evaluated in C++ and memoised per op key, so a region that uses a
// table makes no Python call per op to decide.
//
// Thread-safety: OpNames is thread-safe (one process-wide mutex). OpPolicyTable is
// thread-safe: every method takes the table's mutex (the memo is filled lazily by lookups).

#include "hyper_parallel/activation/CheckpointPolicy.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace hyper_parallel::activation {

class OpNames {
 public:
  // The key of `name` (normalised: "::" -> "."), assigning the next free key on first
  // sight. Keys are dense, start at 0 and are never reused. Throws c10::Error on "".
  static int64_t intern(std::string_view name);
  // The normalised name of `key`. Throws c10::Error for a key that was never assigned.
  static std::string name(int64_t key);
  // Number of keys assigned so far.
  static int64_t size();

  // "ns::op.overload" -> "ns.op.overload"; other names unchanged.
  static std::string normalise(std::string_view name);
  // The packet part of a normalised overload name: "aten.mm.default" -> "aten.mm";
  // "" when `name` has fewer than three dot-separated parts.
  static std::string_view packet_of(std::string_view name);
};

class OpPolicyTable {
 public:
  explicit OpPolicyTable(CheckpointPolicy default_policy = CheckpointPolicy::PREFER_RECOMPUTE);

  // Adds (or replaces) the policy of an overload ("ns.op.overload") or a packet ("ns.op").
  // Throws c10::Error (ValueError in Python) for a name that is neither, e.g. "" or "mm".
  void set(std::string_view name, CheckpointPolicy policy);
  void set_default(CheckpointPolicy policy);
  CheckpointPolicy default_policy() const;

  // Policy of the op whose full name is `op_name` ("aten.mm.default").
  CheckpointPolicy lookup(std::string_view op_name) const;
  // Policy of the op with key `op_key` (OpNames); memoised. Throws for an unknown key.
  CheckpointPolicy policy_for(int64_t op_key) const;

  // Entries in insertion order, names normalised (packets as "ns.op").
  std::vector<std::pair<std::string, CheckpointPolicy>> entries() const;
  size_t size() const;

 private:
  CheckpointPolicy lookup_locked(std::string_view op_name) const;

  mutable std::mutex mu_;
  CheckpointPolicy default_;
  std::unordered_map<std::string, CheckpointPolicy> overloads_;
  std::unordered_map<std::string, CheckpointPolicy> packets_;
  std::vector<std::string> order_;
  // memo_[key]: -1 = not resolved yet, else the policy value.
  mutable std::vector<int8_t> memo_;
};

}  // namespace hyper_parallel::activation
