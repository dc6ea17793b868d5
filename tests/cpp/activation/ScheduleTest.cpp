#include "hyper_parallel/activation/Schedule.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace hyper_parallel::activation {
namespace {

std::shared_ptr<SwapGroup> make_group(int64_t id, int64_t layer, bool manual = false) {
  return std::make_shared<SwapGroup>(id, layer, "", manual, /*group_swap=*/false);
}

// A chain 0 -> 1 -> 2 built with fresh layer ids.
struct Chain {
  Schedule s;
  int64_t l0, l1, l2;
  Chain() : l0(s.new_layer()), l1(s.new_layer()), l2(s.new_layer()) {
    s.link(l0, l1);
    s.link(l1, l2);
  }
};

TEST(ScheduleTest, NewLayerIdsAreDistinct) {
  Schedule s;
  const int64_t a = s.new_layer(), b = s.new_layer(), c = s.new_layer();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 2);
  EXPECT_FALSE(s.scheduled(a));
}

TEST(ScheduleTest, LinkSetsBothDirections) {
  Chain c;
  EXPECT_EQ(c.s.successor(c.l0), c.l1);
  EXPECT_EQ(c.s.successor(c.l1), c.l2);
  EXPECT_EQ(c.s.successor(c.l2), -1);
  EXPECT_EQ(c.s.predecessor(c.l0), -1);
  EXPECT_EQ(c.s.predecessor(c.l1), c.l0);
  EXPECT_EQ(c.s.predecessor(c.l2), c.l1);
  EXPECT_TRUE(c.s.has_successor(c.l0));
  EXPECT_FALSE(c.s.has_predecessor(c.l0));
  EXPECT_TRUE(c.s.has_predecessor(c.l2));
  EXPECT_FALSE(c.s.has_successor(c.l2));
  for (int64_t l : {c.l0, c.l1, c.l2}) EXPECT_TRUE(c.s.scheduled(l));
  // Negative ids (no layer) are never scheduled.
  EXPECT_FALSE(c.s.scheduled(-1));
  EXPECT_FALSE(c.s.has_successor(-1));
  EXPECT_FALSE(c.s.has_predecessor(-1));
}

TEST(ScheduleTest, LinkRejectsBadIds) {
  Schedule s;
  const int64_t a = s.new_layer();
  EXPECT_THROW(s.link(a, a), c10::Error);
  EXPECT_THROW(s.link(-1, a), c10::Error);
  EXPECT_THROW(s.link(a, -3), c10::Error);
  try {
    s.link(a, a);
    FAIL() << "link(a, a) did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hyper_parallel:"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(s.scheduled(a));
}

TEST(ScheduleTest, LinkReplacesEarlierLinksOfEitherLayer) {
  Schedule s;
  const int64_t a = s.new_layer(), b = s.new_layer(), c = s.new_layer(), d = s.new_layer();
  s.link(a, b);
  // a gets a new successor: b loses its predecessor.
  s.link(a, c);
  EXPECT_EQ(s.successor(a), c);
  EXPECT_EQ(s.predecessor(c), a);
  EXPECT_EQ(s.predecessor(b), -1);
  EXPECT_FALSE(s.scheduled(b));
  // c gets a new predecessor: a loses its successor.
  s.link(d, c);
  EXPECT_EQ(s.predecessor(c), d);
  EXPECT_EQ(s.successor(d), c);
  EXPECT_EQ(s.successor(a), -1);
  EXPECT_FALSE(s.scheduled(a));
  // Linking the same pair again is idempotent.
  s.link(d, c);
  EXPECT_EQ(s.predecessor(c), d);
  EXPECT_EQ(s.successor(d), c);
}

// Removing the layers of a dead model brings the bookkeeping back to where it was, links
// and invocations waiting to be linked included (issue 18.3: deep copies).
TEST(ScheduleTest, RemovedLayersLeaveNoBookkeeping) {
  Chain c;
  EXPECT_EQ(c.s.layer_count(), 3u);
  const int64_t a = c.s.new_layer(), b = c.s.new_layer();
  c.s.link(a, b);
  auto ga = make_group(10, a);
  c.s.on_begin(ga);  // an invocation of a, waiting for b's
  EXPECT_EQ(c.s.layer_count(), 5u);
  c.s.remove_layer(a);
  c.s.remove_layer(b);
  EXPECT_EQ(c.s.layer_count(), 3u);
}

// A thread's emptied queue is reused by the layer's next invocation (steady state: one
// queue per layer and thread, whichever thread runs the step), and queues holding no live
// invocation (layers no longer run, threads that are gone) are swept once the map has
// grown: a program that builds a new pair of layers per step does not grow it.
TEST(ScheduleTest, InvocationQueuesAreReusedAndSweptWhenNothingLiveIsInThem) {
  Chain c;
  int64_t id = 0;
  auto step = [&] {
    std::vector<std::shared_ptr<SwapGroup>> live;
    for (int64_t l : {c.l0, c.l1, c.l2}) {
      live.push_back(make_group(id++, l));
      c.s.on_begin(live.back());
    }
    EXPECT_EQ(live[1]->prev.lock(), live[0]);
    EXPECT_EQ(live[2]->prev.lock(), live[1]);
  };
  for (int i = 0; i < 100; ++i) step();
  EXPECT_EQ(c.s.queue_count(), 3u);
  std::thread other(step);
  other.join();
  EXPECT_LE(c.s.queue_count(), 6u);
  for (int i = 0; i < 1000; ++i) {
    const int64_t a = c.s.new_layer(), b = c.s.new_layer();
    c.s.link(a, b);
    auto ga = make_group(id++, a), gb = make_group(id++, b);
    c.s.on_begin(ga);
    c.s.on_begin(gb);
    EXPECT_EQ(gb->prev.lock(), ga);
  }
  EXPECT_LE(c.s.queue_count(), 256u + 2u);
  step();
}

TEST(ScheduleTest, RemoveLayerForgetsBothLinks) {
  Chain c;
  c.s.remove_layer(c.l1);
  EXPECT_EQ(c.s.successor(c.l0), -1);
  EXPECT_EQ(c.s.predecessor(c.l2), -1);
  EXPECT_FALSE(c.s.scheduled(c.l0));
  EXPECT_FALSE(c.s.scheduled(c.l1));
  EXPECT_FALSE(c.s.scheduled(c.l2));
  // Removing an unknown layer is harmless.
  c.s.remove_layer(42);
  // A removed layer's old invocations are not linked to new ones.
  auto g1 = make_group(0, c.l1);
  c.s.on_begin(g1);
  c.s.remove_layer(c.l1);
  c.s.link(c.l1, c.l2);
  auto g2 = make_group(1, c.l2);
  c.s.on_begin(g2);
  EXPECT_EQ(g2->prev.lock(), nullptr);
}

TEST(ScheduleTest, ReleasesAtForwardEnd) {
  Chain c;
  const int64_t lone = c.s.new_layer();
  EXPECT_TRUE(c.s.releases_at_forward_end(*make_group(0, c.l0)));   // first
  EXPECT_TRUE(c.s.releases_at_forward_end(*make_group(1, c.l1)));   // middle
  EXPECT_FALSE(c.s.releases_at_forward_end(*make_group(2, c.l2)));  // last: kept for backward
  EXPECT_TRUE(c.s.releases_at_forward_end(*make_group(3, lone)));   // unscheduled
  EXPECT_TRUE(c.s.releases_at_forward_end(*make_group(4, -1)));     // no layer at all
  // Manual groups are released only by launch_offload, whatever their layer.
  for (int64_t l : {c.l0, c.l1, c.l2, lone, int64_t{-1}}) {
    EXPECT_FALSE(c.s.releases_at_forward_end(*make_group(5, l, /*manual=*/true))) << l;
  }
  // After the chain is extended, the old last layer is a middle layer.
  const int64_t l3 = c.s.new_layer();
  c.s.link(c.l2, l3);
  EXPECT_TRUE(c.s.releases_at_forward_end(*make_group(6, c.l2)));
  EXPECT_FALSE(c.s.releases_at_forward_end(*make_group(7, l3)));
}

TEST(ScheduleTest, OnBeginLinksInvocationsInOrder) {
  Chain c;
  auto g0 = make_group(0, c.l0), g1 = make_group(1, c.l1), g2 = make_group(2, c.l2);
  c.s.on_begin(g0);
  c.s.on_begin(g1);
  c.s.on_begin(g2);
  EXPECT_EQ(g0->prev.lock(), nullptr);
  EXPECT_EQ(g0->next.lock(), g1);
  EXPECT_EQ(g1->prev.lock(), g0);
  EXPECT_EQ(g1->next.lock(), g2);
  EXPECT_EQ(g2->prev.lock(), g1);
  EXPECT_EQ(g2->next.lock(), nullptr);
}

TEST(ScheduleTest, TwoForwardsBeforeBackwardMakeTwoChains) {
  Chain c;
  std::vector<std::shared_ptr<SwapGroup>> a, b;
  int64_t id = 0;
  for (auto* chain : {&a, &b}) {
    for (int64_t l : {c.l0, c.l1, c.l2}) {
      auto g = make_group(id++, l);
      c.s.on_begin(g);
      chain->push_back(g);
    }
  }
  for (auto* chain : {&a, &b}) {
    const auto& g = *chain;
    EXPECT_EQ(g[0]->prev.lock(), nullptr);
    EXPECT_EQ(g[1]->prev.lock(), g[0]);
    EXPECT_EQ(g[2]->prev.lock(), g[1]);
    EXPECT_EQ(g[0]->next.lock(), g[1]);
    EXPECT_EQ(g[1]->next.lock(), g[2]);
  }
  // The chains do not cross.
  EXPECT_NE(b[1]->prev.lock(), a[0]);
  EXPECT_EQ(c.s.prefetch_targets(b[2], 2),
            (std::vector<std::shared_ptr<SwapGroup>>{b[2], b[1], b[0]}));
  EXPECT_EQ(c.s.prefetch_targets(a[2], 2),
            (std::vector<std::shared_ptr<SwapGroup>>{a[2], a[1], a[0]}));
}

TEST(ScheduleTest, AnInvocationIsLinkedAtMostOnce) {
  Chain c;
  // Layer 0 runs twice before layer 1 runs twice (interleaved micro-batches).
  auto g0a = make_group(0, c.l0), g0b = make_group(1, c.l0);
  auto g1a = make_group(2, c.l1), g1b = make_group(3, c.l1);
  c.s.on_begin(g0a);
  c.s.on_begin(g0b);
  c.s.on_begin(g1a);
  c.s.on_begin(g1b);
  // Each layer-1 invocation takes the oldest unlinked layer-0 invocation: micro-batch a
  // links to a, b to b, and no invocation is linked twice.
  EXPECT_EQ(g1a->prev.lock(), g0a);
  EXPECT_EQ(g0a->next.lock(), g1a);
  EXPECT_EQ(g1b->prev.lock(), g0b);
  EXPECT_EQ(g0b->next.lock(), g1b);
}

TEST(ScheduleTest, OnBeginWithoutPredecessorInvocationLinksNothing) {
  Chain c;
  auto g1 = make_group(0, c.l1);  // layer 1 runs before any layer-0 invocation
  c.s.on_begin(g1);
  EXPECT_EQ(g1->prev.lock(), nullptr);
  // A dead predecessor invocation is not linked either.
  {
    auto g0 = make_group(1, c.l0);
    c.s.on_begin(g0);
  }
  auto g1b = make_group(2, c.l1);
  c.s.on_begin(g1b);
  EXPECT_EQ(g1b->prev.lock(), nullptr);
  // Groups without a layer are never linked.
  auto none = make_group(3, -1);
  c.s.on_begin(none);
  EXPECT_EQ(none->prev.lock(), nullptr);
  EXPECT_EQ(none->next.lock(), nullptr);
}

TEST(ScheduleTest, OnAbortUnlinks) {
  Chain c;
  auto g0 = make_group(0, c.l0), g1 = make_group(1, c.l1);
  c.s.on_begin(g0);
  c.s.on_begin(g1);
  ASSERT_EQ(g0->next.lock(), g1);
  c.s.on_abort(g1);
  EXPECT_TRUE(g1->aborted);
  EXPECT_EQ(g1->prev.lock(), nullptr);
  EXPECT_EQ(g0->next.lock(), nullptr);
  // The aborted invocation is not the predecessor of the next layer-2 invocation.
  auto g2 = make_group(2, c.l2);
  c.s.on_begin(g2);
  EXPECT_EQ(g2->prev.lock(), nullptr);
  // The retried layer-1 invocation links to g0 again (g0's link was freed).
  auto g1r = make_group(3, c.l1);
  c.s.on_begin(g1r);
  EXPECT_EQ(g1r->prev.lock(), g0);
  EXPECT_EQ(g0->next.lock(), g1r);
  auto g2r = make_group(4, c.l2);
  c.s.on_begin(g2r);
  EXPECT_EQ(g2r->prev.lock(), g1r);
}

TEST(ScheduleTest, AbortedPredecessorIsNeverLinked) {
  Chain c;
  auto g0 = make_group(0, c.l0);
  c.s.on_begin(g0);
  c.s.on_abort(g0);
  auto g1 = make_group(1, c.l1);
  c.s.on_begin(g1);
  EXPECT_EQ(g1->prev.lock(), nullptr);
  EXPECT_EQ(g0->next.lock(), nullptr);
}

TEST(ScheduleTest, PrefetchTargetsByDepth) {
  Chain c;
  const int64_t l3 = c.s.new_layer();
  c.s.link(c.l2, l3);
  std::vector<std::shared_ptr<SwapGroup>> g;
  for (int64_t l : {c.l0, c.l1, c.l2, l3}) {
    g.push_back(make_group(static_cast<int64_t>(g.size()), l));
    c.s.on_begin(g.back());
  }
  using V = std::vector<std::shared_ptr<SwapGroup>>;
  EXPECT_EQ(c.s.prefetch_targets(g[3], 0), (V{g[3]}));
  EXPECT_EQ(c.s.prefetch_targets(g[3], 1), (V{g[3], g[2]}));
  EXPECT_EQ(c.s.prefetch_targets(g[3], 2), (V{g[3], g[2], g[1]}));
  EXPECT_EQ(c.s.prefetch_targets(g[1], 1), (V{g[1], g[0]}));
  // Depth beyond the start of the chain stops at its first invocation.
  EXPECT_EQ(c.s.prefetch_targets(g[1], 5), (V{g[1], g[0]}));
  EXPECT_EQ(c.s.prefetch_targets(g[0], 2), (V{g[0]}));
  // A dead predecessor ends the walk.
  g[1].reset();
  EXPECT_EQ(c.s.prefetch_targets(g[2], 2), (V{g[2]}));
}

TEST(ScheduleTest, ClearForgetsLinksAndInvocations) {
  Chain c;
  auto g0 = make_group(0, c.l0);
  c.s.on_begin(g0);
  c.s.clear();
  EXPECT_FALSE(c.s.scheduled(c.l0));
  EXPECT_FALSE(c.s.scheduled(c.l1));
  c.s.link(c.l0, c.l1);
  auto g1 = make_group(1, c.l1);
  c.s.on_begin(g1);
  EXPECT_EQ(g1->prev.lock(), nullptr);  // g0 predates clear()
  // Layer ids keep growing after clear(): no id is handed out twice.
  EXPECT_GT(c.s.new_layer(), c.l2);
}


TEST(ScheduleTest, LinkClosingACycleIsRefused) {
  Chain c;
  try {
    c.s.link(c.l2, c.l0);
    FAIL() << "a cycle was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("would close a cycle"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c.s.link(c.l1, c.l0), c10::ValueError);
  // Refused links change nothing.
  EXPECT_EQ(c.s.successor(c.l2), -1);
  EXPECT_EQ(c.s.predecessor(c.l0), -1);
  EXPECT_EQ(c.s.successor(c.l0), c.l1);
  // Re-linking along the chain's direction is fine (it replaces links, no cycle).
  EXPECT_NO_THROW(c.s.link(c.l0, c.l2));
  EXPECT_EQ(c.s.successor(c.l0), c.l2);
}

TEST(ScheduleTest, ForwardAgainstTheChainIsFlagged) {
  Chain c;
  // Reverse order: l2 runs first (it finds no l1 invocation), then l1, then l0.
  auto g2 = make_group(0, c.l2), g1 = make_group(1, c.l1), g0 = make_group(2, c.l0);
  c.s.on_begin(g2);
  c.s.on_begin(g1);
  c.s.on_begin(g0);
  EXPECT_TRUE(g2->orphan);
  EXPECT_FALSE(g2->order_reversed);
  EXPECT_TRUE(g1->order_reversed);
  EXPECT_TRUE(g0->order_reversed);
  // A chain whose order is not the forward's, without a reversed link (layers given out
  // of order): chain l2 -> l0 -> l1, forward l0, l1, l2. l0 finds no l2 invocation (the
  // first layer run: not flagged itself); l2 begins while l0, which runs after it in the
  // chain, is an alive orphan.
  {
    Schedule s;
    const int64_t l0 = s.new_layer(), l1 = s.new_layer(), l2 = s.new_layer();
    s.link(l2, l0);
    s.link(l0, l1);
    auto a = make_group(10, l0), b = make_group(11, l1), e = make_group(12, l2);
    s.on_begin(a);
    s.on_begin(b);
    s.on_begin(e);
    EXPECT_TRUE(a->orphan);
    EXPECT_FALSE(a->order_reversed);
    EXPECT_FALSE(b->order_reversed);
    EXPECT_TRUE(e->order_reversed);
    // l3 -> l1 -> l2 -> l0 against l0, l1, l2, l3: l1 is an orphan after l0 began.
    Schedule t;
    const int64_t m0 = t.new_layer(), m1 = t.new_layer(), m2 = t.new_layer(),
                  m3 = t.new_layer();
    t.link(m3, m1);
    t.link(m1, m2);
    t.link(m2, m0);
    std::vector<std::shared_ptr<SwapGroup>> gs;
    for (int64_t layer : {m0, m1, m2, m3}) {
      gs.push_back(make_group(20 + layer, layer));
      t.on_begin(gs.back());
    }
    EXPECT_FALSE(gs[0]->order_reversed);
    EXPECT_TRUE(gs[1]->order_reversed);
    EXPECT_TRUE(gs[3]->order_reversed);
  }
  // A layer called again in the same forward (weight sharing: l0, l1, l2, l1 over
  // l0 -> l1 -> l2) finds no free predecessor invocation, but its predecessor ran: not
  // against the chain, and the next pass (another micro-batch, the first still alive) is
  // not flagged either.
  {
    Chain w;
    std::vector<std::shared_ptr<SwapGroup>> live;
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t layer : {w.l0, w.l1, w.l2, w.l1}) {
        live.push_back(make_group(100 + static_cast<int64_t>(live.size()), layer));
        w.s.on_begin(live.back());
        EXPECT_FALSE(live.back()->order_reversed) << pass << " " << layer;
      }
    }
    EXPECT_TRUE(live[3]->orphan);
  }
  // In order, twice (the second pass starts right after the first pass's last layer):
  // never flagged.
  Chain d;
  std::vector<std::shared_ptr<SwapGroup>> keep;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t layer : {d.l0, d.l1, d.l2}) {
      keep.push_back(make_group(static_cast<int64_t>(keep.size()), layer));
      d.s.on_begin(keep.back());
      EXPECT_FALSE(keep.back()->order_reversed) << pass << " " << layer;
      EXPECT_FALSE(keep.back()->orphan) << pass << " " << layer;
    }
  }
}

}  // namespace
}  // namespace hyper_parallel::activation
