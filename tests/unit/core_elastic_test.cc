// Elastic resume: the layout chooser and the batch split that keeps the saved global batch.
#include <gtest/gtest.h>

#include <string>

#include "reshard/elastic.h"
#include "reshard/error.h"

namespace reshard {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

const Topology kSaved = Topology::parse("tp=2,pp=2,dp=2,zero=1");  // 8 ranks

TEST(ElasticChooser, KeepPolicyKeepsModelParallelAndDerivesDp) {
  ElasticPolicy p;  // keep
  LayoutChoice c = choose_layout(kSaved, 4, p);
  EXPECT_EQ(c.target, Topology::parse("tp=2,pp=2,dp=1,zero=1"));
  EXPECT_NE(c.reason.find("world size 8 -> 4"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("dp 2 -> 1"), std::string::npos) << c.reason;
  EXPECT_EQ(choose_layout(kSaved, 16, p).target, Topology::parse("tp=2,pp=2,dp=4,zero=1"));
  const LayoutChoice same = choose_layout(kSaved, 8, p);
  EXPECT_EQ(same.target, kSaved);
  EXPECT_NE(same.reason.find("unchanged"), std::string::npos) << same.reason;
  Topology v = kSaved;
  v.vpp = 2;
  EXPECT_EQ(choose_layout(v, 12, p).target.vpp, 2);
  EXPECT_EQ(choose_layout(v, 12, p).target.dp, 3);
}

TEST(ElasticChooser, KeepPolicyNamesTheWorldSizeWhenTpTimesPpDoesNotDivideIt) {
  const std::string m = error_of([] { choose_layout(kSaved, 6, ElasticPolicy{}); });
  EXPECT_NE(m.find("world size 6"), std::string::npos) << m;
  EXPECT_NE(m.find("not a multiple of tp*pp = 4"), std::string::npos) << m;
  EXPECT_NE(m.find("policy 'keep'"), std::string::npos) << m;
  EXPECT_NE(m.find(kSaved.to_string()), std::string::npos) << m;
}

TEST(ElasticChooser, GlobalBatchMustStayDivisibleByTheNewDp) {
  // 12 ranks keep tp*pp = 4 -> dp 3, which does not divide a global batch of 8.
  const std::string m = error_of([] { choose_layout(kSaved, 12, ElasticPolicy{}, 8); });
  EXPECT_NE(m.find("global batch 8 is not divisible by dp=3"), std::string::npos) << m;
  EXPECT_EQ(choose_layout(kSaved, 12, ElasticPolicy{}, 24).target.dp, 3);
}

TEST(ElasticChooser, ListPolicyTakesTheFirstThatFitsAndReportsTheRest) {
  ElasticPolicy p;
  p.kind = ElasticPolicy::Kind::kAllowedList;
  p.allowed = {parse_candidate("tp=4,pp=2", kSaved), parse_candidate("tp=2,pp=1,dp=4", kSaved),
               parse_candidate("tp=1,pp=1", kSaved)};
  EXPECT_EQ(p.allowed[0].zero, 1) << "an omitted ZeRO stage keeps the saved one";
  EXPECT_EQ(p.allowed[0].dp, 0) << "an omitted dp is derived";
  EXPECT_EQ(p.allowed[1].dp, 4);
  LayoutChoice c = choose_layout(kSaved, 4, p);
  // tp=4,pp=2 needs 8; tp=2,pp=1,dp=4 needs 8; tp=1,pp=1 takes dp=4.
  EXPECT_EQ(c.target, Topology::parse("tp=1,pp=1,dp=4,zero=1"));
  ASSERT_EQ(c.tried.size(), 2u);
  EXPECT_NE(c.tried[0].find("world size 4 is not a multiple of tp*pp = 8"), std::string::npos) << c.tried[0];
  EXPECT_NE(c.tried[1].find("world size 8 != 4"), std::string::npos) << c.tried[1];
  EXPECT_NE(c.tried[1].find("allowed[1]"), std::string::npos) << c.tried[1];
  EXPECT_NE(c.reason.find("allowed[2]"), std::string::npos) << c.reason;
  EXPECT_EQ(choose_layout(kSaved, 8, p).target, Topology::parse("tp=4,pp=2,dp=1,zero=1"));
}

TEST(ElasticChooser, ListPolicyAsksTheModelAndListsEveryRejection) {
  ElasticPolicy p;
  p.kind = ElasticPolicy::Kind::kAllowedList;
  p.allowed = {parse_candidate("tp=4", kSaved), parse_candidate("tp=3", kSaved)};
  auto heads_of_8 = [](const Topology& t) {
    return 8 % t.tp == 0 ? std::string() : "tp=" + std::to_string(t.tp) + " does not divide 8 heads";
  };
  EXPECT_EQ(choose_layout(kSaved, 4, p, 0, heads_of_8).target.tp, 4);
  const std::string m = error_of([&] { choose_layout(kSaved, 3, p, 0, heads_of_8); });
  EXPECT_NE(m.find("world size 3"), std::string::npos) << m;
  EXPECT_NE(m.find("allowed[0] tp=4,pp=1,vpp=1,dp=0,zero=1: world size 3 is not a multiple of tp*pp = 4"),
            std::string::npos) << m;
  EXPECT_NE(m.find("tp=3 does not divide 8 heads"), std::string::npos) << m;
  p.allowed.clear();
  const std::string e = error_of([&] { choose_layout(kSaved, 4, p); });
  EXPECT_NE(e.find("the allowed list is empty"), std::string::npos) << e;
}

TEST(ElasticChooser, RefusePolicyAllowsOnlyTheSavedWorldSize) {
  ElasticPolicy p;
  p.kind = ElasticPolicy::Kind::kRefuse;
  EXPECT_EQ(choose_layout(kSaved, 8, p).target, kSaved);
  const std::string m = error_of([&] { choose_layout(kSaved, 4, p); });
  EXPECT_NE(m.find("only the saved world size 8"), std::string::npos) << m;
  EXPECT_NE(m.find("world size 4"), std::string::npos) << m;
}

TEST(ElasticChooser, BadInputsAreNamed) {
  EXPECT_NE(error_of([] { choose_layout(kSaved, 0, ElasticPolicy{}); }).find("world size 0"), std::string::npos);
  EXPECT_NE(error_of([] { choose_layout(kSaved, 1 << 20, ElasticPolicy{}); }).find("outside 1.."), std::string::npos);
  EXPECT_NE(error_of([] { ElasticPolicy::parse_kind("grow"); }).find("'grow' is unknown"), std::string::npos);
  EXPECT_NE(error_of([] { parse_candidate("tp=two", kSaved); }).find("tp='two'"), std::string::npos);
  EXPECT_EQ(ElasticPolicy::parse_kind("list"), ElasticPolicy::Kind::kAllowedList);
  EXPECT_STREQ(ElasticPolicy::kind_name(ElasticPolicy::Kind::kRefuse), "refuse");
}

TEST(ElasticBatch, KeepsTheGlobalBatchAndTheMicroBatchWhereItCan) {
  BatchPlan b = plan_batch(32, 2, 4);
  EXPECT_EQ(b.micro_batch, 2);
  EXPECT_EQ(b.grad_accum, 4);
  EXPECT_TRUE(b.reason.empty());
  b = plan_batch(32, 2, 8);
  EXPECT_EQ(b.grad_accum, 2);
  // 24 over dp=8 is 3 per rank: micro-batch 2 does not divide it, 1 does.
  b = plan_batch(24, 2, 8);
  EXPECT_EQ(b.micro_batch, 1);
  EXPECT_EQ(b.grad_accum, 3);
  EXPECT_NE(b.reason.find("micro-batch 2 -> 1"), std::string::npos) << b.reason;
  // Fewer samples per rank than the micro-batch.
  b = plan_batch(8, 4, 4);
  EXPECT_EQ(b.micro_batch, 2);
  EXPECT_EQ(b.grad_accum, 1);
  EXPECT_EQ(b.micro_batch * b.grad_accum * 4, 8);
  for (int64_t g : {8, 12, 24, 48})
    for (int64_t mb : {1, 2, 3, 4})
      for (int64_t dp : {1, 2, 3, 4, 6, 8})
        if (g % dp == 0) {
          const BatchPlan x = plan_batch(g, mb, dp);
          EXPECT_EQ(x.micro_batch * x.grad_accum * dp, g) << g << " " << mb << " " << dp;
          EXPECT_LE(x.micro_batch, mb);
        }
}

TEST(ElasticBatch, RefusesAGlobalBatchTheNewDpDoesNotDivide) {
  const std::string m = error_of([] { plan_batch(8, 2, 3); });
  EXPECT_NE(m.find("global batch 8 is not divisible by dp=3"), std::string::npos) << m;
  EXPECT_NE(error_of([] { plan_batch(8, 0, 2); }).find("micro-batch 0"), std::string::npos);
}

}  // namespace
}  // namespace reshard
