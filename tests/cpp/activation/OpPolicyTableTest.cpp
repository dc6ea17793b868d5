#include "hyper_parallel/activation/OpPolicyTable.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

namespace hyper_parallel::activation {
namespace {

using P = CheckpointPolicy;

TEST(OpPolicyTableTest, InternGivesStableDenseKeysAndNormalisesSchemaSpelling) {
  const int64_t before = OpNames::size();
  const int64_t a = OpNames::intern("optabletest.alpha.default");
  const int64_t b = OpNames::intern("optabletest.beta.default");
  EXPECT_EQ(a, before);
  EXPECT_EQ(b, before + 1);
  EXPECT_EQ(OpNames::intern("optabletest.alpha.default"), a);
  EXPECT_EQ(OpNames::intern("optabletest::alpha.default"), a);  // "::" is normalised
  EXPECT_EQ(OpNames::name(a), "optabletest.alpha.default");
  EXPECT_EQ(OpNames::size(), before + 2);
}

TEST(OpPolicyTableTest, UnknownKeyAndEmptyNameThrowWithPrefix) {
  try {
    OpNames::name(1 << 30);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hyper_parallel: unknown op key"), std::string::npos);
  }
  EXPECT_THROW(OpNames::intern(""), c10::Error);
  OpPolicyTable table;
  EXPECT_THROW(table.policy_for(-1), c10::Error);
}

TEST(OpPolicyTableTest, PacketOfSplitsOverloadNamesOnly) {
  EXPECT_EQ(OpNames::packet_of("aten.mm.default"), "aten.mm");
  EXPECT_EQ(OpNames::packet_of("aten.mm"), "");
  EXPECT_EQ(OpNames::packet_of("mm"), "");
  EXPECT_EQ(OpNames::packet_of("aten..default"), "");
}

TEST(OpPolicyTableTest, OverloadPacketAndDefault) {
  OpPolicyTable table;  // default PREFER_RECOMPUTE
  table.set("aten.mm", P::MUST_SAVE);                  // every overload of mm
  table.set("aten.addmm.default", P::MUST_SWAP);       // one overload
  table.set("aten::bmm", P::PREFER_SAVE);              // schema spelling of a packet
  EXPECT_EQ(table.lookup("aten.mm.default"), P::MUST_SAVE);
  EXPECT_EQ(table.lookup("aten.mm.out"), P::MUST_SAVE);
  EXPECT_EQ(table.lookup("aten.mm.dtype"), P::MUST_SAVE);
  EXPECT_EQ(table.lookup("aten::mm.default"), P::MUST_SAVE);
  EXPECT_EQ(table.lookup("aten.addmm.default"), P::MUST_SWAP);
  EXPECT_EQ(table.lookup("aten.addmm.out"), P::PREFER_RECOMPUTE);  // other overload: default
  EXPECT_EQ(table.lookup("aten.bmm.default"), P::PREFER_SAVE);
  EXPECT_EQ(table.lookup("aten.relu.default"), P::PREFER_RECOMPUTE);
  // "aten.mm" must not match "aten.mmx" or "aten.m".
  EXPECT_EQ(table.lookup("aten.mmx.default"), P::PREFER_RECOMPUTE);
  EXPECT_EQ(table.lookup("aten.m.default"), P::PREFER_RECOMPUTE);
  EXPECT_EQ(table.size(), 3u);
}

TEST(OpPolicyTableTest, OverloadEntryWinsOverPacketEntry) {
  OpPolicyTable table(P::MUST_SAVE);
  table.set("aten.mm", P::MUST_SWAP);
  table.set("aten.mm.out", P::MUST_RECOMPUTE);
  EXPECT_EQ(table.lookup("aten.mm.default"), P::MUST_SWAP);
  EXPECT_EQ(table.lookup("aten.mm.out"), P::MUST_RECOMPUTE);
  EXPECT_EQ(table.lookup("aten.sin.default"), P::MUST_SAVE);  // default
}

TEST(OpPolicyTableTest, EveryPolicyValueIsStorable) {
  OpPolicyTable table;
  const char* names[] = {"t.a.default", "t.b.default", "t.c.default", "t.d.default",
                         "t.e.default"};
  for (int i = 0; i < kNumCheckpointPolicies; ++i) {
    table.set(names[i], static_cast<P>(i));
  }
  for (int i = 0; i < kNumCheckpointPolicies; ++i) {
    EXPECT_EQ(table.lookup(names[i]), static_cast<P>(i));
  }
}

TEST(OpPolicyTableTest, RejectsNamesThatWouldMatchNothing) {
  OpPolicyTable table;
  for (const char* bad : {"", "mm", "aten.", ".mm", "aten..default", "a.b.c.d", "LayerNormExt"}) {
    try {
      table.set(bad, P::MUST_SAVE);
      FAIL() << "expected an error for '" << bad << "'";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("hyper_parallel: '"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'aten.mm.default'"), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(table.size(), 0u);
}

TEST(OpPolicyTableTest, PolicyForIsMemoisedAndRefreshedBySet) {
  OpPolicyTable table;
  const int64_t key = OpNames::intern("optabletest.gamma.default");
  EXPECT_EQ(table.policy_for(key), P::PREFER_RECOMPUTE);
  EXPECT_EQ(table.policy_for(key), P::PREFER_RECOMPUTE);  // from the memo
  table.set("optabletest.gamma", P::MUST_SAVE);
  EXPECT_EQ(table.policy_for(key), P::MUST_SAVE);
  table.set("optabletest.gamma.default", P::MUST_SWAP);
  EXPECT_EQ(table.policy_for(key), P::MUST_SWAP);
  const int64_t other = OpNames::intern("optabletest.delta.default");
  EXPECT_EQ(table.policy_for(other), P::PREFER_RECOMPUTE);
  table.set_default(P::PREFER_SAVE);
  EXPECT_EQ(table.default_policy(), P::PREFER_SAVE);
  EXPECT_EQ(table.policy_for(other), P::PREFER_SAVE);
}

TEST(OpPolicyTableTest, EntriesKeepInsertionOrderAndReplaceInPlace) {
  OpPolicyTable table;
  table.set("aten.mm", P::MUST_SAVE);
  table.set("aten.addmm.default", P::MUST_SWAP);
  table.set("aten::mm", P::PREFER_SAVE);  // replaces the first entry
  auto entries = table.entries();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].first, "aten.mm");
  EXPECT_EQ(entries[0].second, P::PREFER_SAVE);
  EXPECT_EQ(entries[1].first, "aten.addmm.default");
  EXPECT_EQ(entries[1].second, P::MUST_SWAP);
}

TEST(OpPolicyTableTest, ConcurrentInternAndLookupAgree) {
  OpPolicyTable table;
  table.set("optabletest.par", P::MUST_SAVE);
  constexpr int kThreads = 4;
  constexpr int kNames = 200;
  std::vector<std::vector<int64_t>> keys(kThreads);
  std::vector<int> saves(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kNames; ++i) {
        const std::string name = "optabletest.par.o" + std::to_string(i);
        const int64_t k = OpNames::intern(name);
        keys[t].push_back(k);
        if (table.policy_for(k) == P::MUST_SAVE) ++saves[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 1; t < kThreads; ++t) EXPECT_EQ(keys[t], keys[0]);
  EXPECT_EQ(std::set<int64_t>(keys[0].begin(), keys[0].end()).size(), size_t{kNames});
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(saves[t], kNames);
}

}  // namespace
}  // namespace hyper_parallel::activation
