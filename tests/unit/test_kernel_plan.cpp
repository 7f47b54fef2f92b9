// The CUDA kernel plan's host side (no GPU needed): the --kernels parser, the switches it sets, TANSY_KERNELS as
// the override on top, and the plan's description of its choices.
#include <gtest/gtest.h>

#include <cstdlib>

#include "backend/backend.h"
#include "backend/cuda/kernel_plan.h"

using namespace tansy;

TEST(kernel_plan, parses_kernel_options) {
    kernel_options o;
    EXPECT_EQ(cuda::parse_kernel_options("mma=gemv1+down,int8=off,wgmma=on", &o), "");
    EXPECT_EQ(o.mma_families, (int)(cuda::mma_gemv1 | cuda::mma_down));
    EXPECT_EQ(o.int8_inputs, 0);
    EXPECT_EQ(o.gemm_wgmma, 1);
    kernel_options n;
    EXPECT_EQ(cuda::parse_kernel_options("mma=none", &n), "");
    EXPECT_EQ(n.mma_families, 0);
    EXPECT_EQ(n.int8_inputs, -1);  // unset keys keep the plan's default
    EXPECT_EQ(cuda::parse_kernel_options("mma=all", &n), "");
    EXPECT_EQ(n.mma_families, (int)cuda::mma_all);
    EXPECT_EQ(cuda::parse_kernel_options("", &n), "");
    EXPECT_EQ(cuda::parse_kernel_options("int8=on;wgmma=off", &n), "");  // ';' as scripts/device.sh ab-multi needs
    EXPECT_EQ(n.int8_inputs, 1);
    EXPECT_EQ(n.gemm_wgmma, 0);
    EXPECT_EQ(n.gemm_tma, -1);
    EXPECT_EQ(cuda::parse_kernel_options("tma=off", &n), "");
    EXPECT_EQ(n.gemm_tma, 0);
    EXPECT_NE(cuda::parse_kernel_options("tma=maybe", &n), "");
    EXPECT_EQ(n.moe_groups, -1);
    EXPECT_EQ(cuda::parse_kernel_options("moe_groups=64", &n), "");
    EXPECT_EQ(n.moe_groups, 64);
    EXPECT_EQ(cuda::parse_kernel_options("dense_groups=32;moe_groups=0", &n), "");
    EXPECT_EQ(n.dense_groups, 32);
    EXPECT_EQ(cuda::parse_kernel_options("gemm_split=4", &n), "");
    EXPECT_EQ(n.gemm_split, 4);
    EXPECT_NE(cuda::parse_kernel_options("gemm_split=65", &n), "");
    EXPECT_EQ(n.moe_groups, 0);
    EXPECT_EQ(n.moe_small, -1);
    EXPECT_EQ(cuda::parse_kernel_options("moe_small=128", &n), "");
    EXPECT_EQ(n.moe_small, 128);
    EXPECT_EQ(cuda::parse_kernel_options("moe_groups=32,moe_small=0", &n), "");
    EXPECT_EQ(n.moe_small, 0);
    EXPECT_EQ(cuda::parse_kernel_options("dense_rows=16;moe_small_gu=2;moe_small_dn=4", &n), "");
    EXPECT_EQ(n.dense_rows, 16);
    EXPECT_EQ(n.moe_small_gate_up_items, 2);
    EXPECT_EQ(n.moe_small_down_items, 4);
    EXPECT_NE(cuda::parse_kernel_options("dense_rows=8", &n), "");    // below a 16-row group
    EXPECT_NE(cuda::parse_kernel_options("dense_rows=33", &n), "");   // past the kernel's 32
    EXPECT_NE(cuda::parse_kernel_options("moe_small_dn=0", &n), "");
    EXPECT_NE(cuda::parse_kernel_options("moe_small_gu=x", &n), "");
    EXPECT_EQ(n.moe_groups, 32);
    for (const char* bad : {"mma=gemv2", "int8=maybe", "tiles=64", "int8", "moe_groups=-1", "moe_groups=", "moe_groups=8x",
                            "moe_small=-3", "moe_small=", "moe_small=all", "moe_small=5000"}) {
        kernel_options b;
        EXPECT_NE(cuda::parse_kernel_options(bad, &b), "") << bad;
    }
}

TEST(kernel_plan, defaults_options_and_the_environment_override) {
    unsetenv("TANSY_KERNELS");
    const cuda::kernel_plan d = cuda::make_kernel_plan({}, nullptr, false, {});
    EXPECT_EQ(d.mma_families, cuda::k_mma_default_families);
    EXPECT_TRUE(d.int8_inputs);
    EXPECT_TRUE(d.gemm_wgmma);
    EXPECT_FALSE(d.wgmma());  // no device offers it
    EXPECT_EQ(d.source, "defaults");
    EXPECT_FALSE(cuda::kernel_plan::use_gemm(cuda::k_gemm_min_rows - 1));
    EXPECT_TRUE(cuda::kernel_plan::use_gemm(cuda::k_gemm_min_rows));

    kernel_options o;
    o.int8_inputs = 0;
    const cuda::kernel_plan p = cuda::make_kernel_plan({}, nullptr, false, o);
    EXPECT_FALSE(p.int8_inputs);
    EXPECT_EQ(p.source, "--kernels");

    setenv("TANSY_KERNELS", "int8=on,mma=all", 1);
    const cuda::kernel_plan e = cuda::make_kernel_plan({}, nullptr, false, o);
    unsetenv("TANSY_KERNELS");
    EXPECT_TRUE(e.int8_inputs);  // the debug override has the last word
    EXPECT_EQ(e.mma_families, (unsigned)cuda::mma_all);
    EXPECT_NE(e.source.find("TANSY_KERNELS=int8=on,mma=all"), std::string::npos) << e.source;
}

TEST(kernel_plan, describes_each_row_range) {
    cuda::kernel_device dev;
    dev.name = "test device", dev.cc = 90, dev.sms = 132, dev.smem_optin = 227 * 1024, dev.wgmma = true;
    const std::string s = cuda::make_kernel_plan(dev, nullptr, false, {}).describe("  ");
    for (const char* want :
         {"device     test device: compute capability 9.0, 132 SMs", "mma=gemvn int8=on wgmma=on", "1 row", "2-16 rows",
          "17+ rows   dense: GEMM, 4-bit on wgmma", "from 512 rows 256-token tiles",
          "80-token tiles once experts average 48 rows (wgmma)", "attention  spans < 16 rows",
          "deltanet   spans <= 16 rows"})
        EXPECT_NE(s.find(want), std::string::npos) << want << "\n" << s;
    EXPECT_NE(s.find("\n  "), std::string::npos);  // continuation lines take the indent
    EXPECT_NE(s.find("17-96 rows  moe: the decode kernels"), std::string::npos) << s;  // the default
    EXPECT_NE(s.find("gemm split dense GEMMs"), std::string::npos) << s;
    kernel_options no_split;
    no_split.gemm_split = 0;
    EXPECT_NE(cuda::make_kernel_plan(dev, nullptr, false, no_split).describe().find("gemm split off"), std::string::npos);
    kernel_options no_wgmma;
    no_wgmma.gemm_wgmma = 0;
    EXPECT_NE(cuda::make_kernel_plan(dev, nullptr, false, no_wgmma).describe().find("from 512 rows 128-row tiles where they fit (mma.sync)"),
              std::string::npos);
    EXPECT_NE(cuda::make_kernel_plan(dev, nullptr, false, no_wgmma).describe().find("128-row tiles once experts average that many"),
              std::string::npos);
    kernel_options off;
    off.moe_groups = off.dense_groups = 0;
    const cuda::kernel_plan p0 = cuda::make_kernel_plan(dev, nullptr, false, off);
    EXPECT_EQ(p0.describe().find("rows  moe: the decode kernels"), std::string::npos);
    EXPECT_NE(p0.describe().find("17+ rows   moe: grouped GEMMs"), std::string::npos) << p0.describe();
    EXPECT_FALSE(p0.moe_in_groups(17));
    EXPECT_FALSE(p0.dense_in_groups(17));
    kernel_options g;
    g.moe_groups = 64, g.dense_groups = 0;
    const cuda::kernel_plan pg = cuda::make_kernel_plan(dev, nullptr, false, g);
    EXPECT_NE(pg.describe().find("17-64 rows  moe: the decode kernels above in groups of <= 16 rows"), std::string::npos)
        << pg.describe();
    EXPECT_NE(pg.describe().find("65+ rows   moe: grouped GEMMs"), std::string::npos) << pg.describe();
    EXPECT_FALSE(pg.moe_in_groups(16));
    EXPECT_TRUE(pg.moe_in_groups(17));
    EXPECT_TRUE(pg.moe_in_groups(64));
    EXPECT_FALSE(pg.moe_in_groups(65));
    EXPECT_FALSE(pg.dense_in_groups(17));  // its own switch (0: off)
    g.dense_groups = 32;
    const cuda::kernel_plan pd = cuda::make_kernel_plan(dev, nullptr, false, g);
    EXPECT_NE(pd.describe().find("17-32 rows  dense: the 2-16 row kernels above in groups of <= 16 rows"), std::string::npos)
        << pd.describe();
    EXPECT_NE(pd.describe().find("33+ rows   dense: GEMM"), std::string::npos) << pd.describe();
    EXPECT_TRUE(pd.dense_in_groups(32));
    EXPECT_FALSE(pd.dense_in_groups(33));
    kernel_options o;
    o.gemm_wgmma = 0;
    EXPECT_NE(cuda::make_kernel_plan(dev, nullptr, true, o).describe().find("precise"), std::string::npos);
}

// moe_small: MoE blocks of 17 .. N rows on the small-M grouped kernels, fast mode only, ahead of moe_groups from
// k_moe_small_min_rows rows (below it where moe_groups takes the rows).
TEST(kernel_plan, moe_small_rows) {
    cuda::kernel_device dev;
    dev.name = "test device", dev.cc = 90, dev.sms = 132, dev.smem_optin = 227 * 1024;
    const cuda::kernel_plan d = cuda::make_kernel_plan(dev, nullptr, false, {});
    EXPECT_EQ(d.moe_small, cuda::k_moe_small_max_rows);
    EXPECT_FALSE(d.moe_in_small(cuda::k_gemm_min_rows - 1));
    EXPECT_FALSE(d.moe_in_small(cuda::k_gemm_min_rows));  // the groups' rows
    EXPECT_FALSE(d.moe_in_small(cuda::k_moe_small_min_rows - 1));
    EXPECT_TRUE(d.moe_in_small(cuda::k_moe_small_min_rows));
    EXPECT_TRUE(d.moe_in_small(cuda::k_moe_small_max_rows));
    EXPECT_FALSE(d.moe_in_small(cuda::k_moe_small_max_rows + 1));
    EXPECT_NE(d.describe().find("moe_small=256"), std::string::npos) << d.describe();
    EXPECT_NE(d.describe().find("32-256 rows moe: small-M grouped kernels"), std::string::npos) << d.describe();
    const cuda::kernel_plan precise = cuda::make_kernel_plan(dev, nullptr, true, {});
    EXPECT_FALSE(precise.moe_in_small(32));  // fast mode only
    EXPECT_EQ(precise.describe().find("small-M"), std::string::npos) << precise.describe();
    kernel_options o;
    o.moe_small = 0;
    const cuda::kernel_plan off = cuda::make_kernel_plan(dev, nullptr, false, o);
    EXPECT_FALSE(off.moe_in_small(17));
    EXPECT_EQ(off.describe().find("small-M"), std::string::npos) << off.describe();
    EXPECT_EQ(off.source, "--kernels");
    o.moe_small = 64;
    o.moe_groups = 0;  // no groups: the small-M kernels from 17 rows
    const cuda::kernel_plan p64 = cuda::make_kernel_plan(dev, nullptr, false, o);
    EXPECT_TRUE(p64.moe_in_small(17));
    EXPECT_TRUE(p64.moe_in_small(64));
    EXPECT_FALSE(p64.moe_in_small(65));
    EXPECT_NE(p64.describe().find("17-64 rows moe: small-M"), std::string::npos) << p64.describe();
}

// Each backend points the launchers at its own plan (fast and precise engines share a test process); a forced
// form holds over every plan until it is restored, and a released plan leaves the defaults active.
TEST(kernel_plan, launchers_read_the_calling_backends_plan_and_forced_forms) {
    unsetenv("TANSY_KERNELS");
    kernel_options ob;
    ob.int8_inputs = 0, ob.recur = 1, ob.mma_families = (int)cuda::mma_all;
    const cuda::kernel_plan a = cuda::make_kernel_plan({}, nullptr, false, {}),
                            b = cuda::make_kernel_plan({}, nullptr, false, ob);
    ASSERT_TRUE(a.int8_inputs);
    ASSERT_NE(a.mma_families, (unsigned)cuda::mma_all);
    const cuda::kernel_plan* defaults = &cuda::active_kernel_plan();
    cuda::use_kernel_plan(&b);
    EXPECT_EQ(&cuda::active_kernel_plan(), &b);
    EXPECT_FALSE(cuda::decode_int8_inputs());
    EXPECT_TRUE(cuda::deltanet_recur_smem(1));
    EXPECT_EQ(cuda::decode_mma_families(), (unsigned)cuda::mma_all);
    cuda::use_kernel_plan(&a);
    EXPECT_TRUE(cuda::decode_int8_inputs());
    EXPECT_FALSE(cuda::deltanet_recur_smem(1));
    EXPECT_EQ(cuda::decode_mma_families(), a.mma_families);

    EXPECT_EQ(cuda::force_int8_inputs(false), std::nullopt);
    EXPECT_EQ(cuda::force_deltanet_recur(0), std::nullopt);
    EXPECT_EQ(cuda::force_mma_families(~0u), std::nullopt);
    for (const cuda::kernel_plan* p : {&a, &b}) {
        cuda::use_kernel_plan(p);
        EXPECT_FALSE(cuda::decode_int8_inputs());
        EXPECT_FALSE(cuda::deltanet_recur_smem(256));
        EXPECT_EQ(cuda::decode_mma_families(), (unsigned)cuda::mma_all) << "forced families are masked";
    }
    EXPECT_EQ(cuda::force_int8_inputs(std::nullopt), std::optional<bool>(false));
    EXPECT_EQ(cuda::force_deltanet_recur(std::nullopt), std::optional<int>(0));
    EXPECT_EQ(cuda::force_mma_families(std::nullopt), std::optional<unsigned>(cuda::mma_all));
    EXPECT_FALSE(cuda::decode_int8_inputs()) << "b's own again";
    EXPECT_TRUE(cuda::deltanet_recur_smem(1));

    cuda::release_kernel_plan(&a);  // not active: nothing changes
    EXPECT_EQ(&cuda::active_kernel_plan(), &b);
    cuda::release_kernel_plan(&b);
    EXPECT_EQ(&cuda::active_kernel_plan(), defaults);
    cuda::use_kernel_plan(&a);
    cuda::use_kernel_plan(nullptr);
    EXPECT_EQ(&cuda::active_kernel_plan(), defaults);
}

// recur: the DeltaNet decode state in registers for small batches, staged in shared memory from
// k_recur_smem_min_spans sequences; recur=0 / 1 forces one form.
TEST(kernel_plan, deltanet_recur_form) {
    const cuda::kernel_plan d = cuda::make_kernel_plan({}, nullptr, false, {});
    EXPECT_EQ(d.recur, -1);
    EXPECT_FALSE(d.recur_smem(1));
    EXPECT_FALSE(d.recur_smem(cuda::k_recur_smem_min_spans - 1));
    EXPECT_TRUE(d.recur_smem(cuda::k_recur_smem_min_spans));
    EXPECT_TRUE(d.recur_smem(256));
    EXPECT_NE(d.describe().find("recur=-1"), std::string::npos) << d.describe();
    EXPECT_NE(d.describe().find("registers below " + std::to_string(cuda::k_recur_smem_min_spans)), std::string::npos)
        << d.describe();
    for (int form : {0, 1}) {
        kernel_options o;
        EXPECT_EQ(cuda::parse_kernel_options("recur=" + std::to_string(form), &o), "");
        EXPECT_EQ(o.recur, form);
        const cuda::kernel_plan p = cuda::make_kernel_plan({}, nullptr, false, o);
        EXPECT_EQ(p.recur_smem(1), form == 1);
        EXPECT_EQ(p.recur_smem(256), form == 1);
        EXPECT_EQ(p.source, "--kernels");
    }
    for (const char* bad : {"recur=2", "recur=", "recur=smem", "recur=-1"}) {
        kernel_options b;
        EXPECT_NE(cuda::parse_kernel_options(bad, &b), "") << bad;
    }
}
