package org.basalt.webhdfs;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.contract.AbstractContractRootDirectoryTest;
import org.apache.hadoop.fs.contract.AbstractFSContract;
import static org.apache.hadoop.fs.contract.ContractTestUtils.skip;

import org.junit.Test;

public class TestBasaltContractRootDirectory extends AbstractContractRootDirectoryTest {
  @Override
  protected AbstractFSContract createContract(Configuration conf) {
    return new BasaltContract(conf);
  }

  // The namespace is rooted like Ozone's ofs: "/" holds volumes and a
  // volume holds buckets, so a file directly under "/" cannot exist (CREATE
  // answers IOException). These two tests start by creating one.

  @Override
  @Test
  public void testRmNonEmptyRootDirNonRecursive() throws Throwable {
    skip("a file cannot be created directly under / (ofs layout: /volume/bucket/path)");
  }

  @Override
  @Test
  public void testRmRootRecursive() throws Throwable {
    skip("a file cannot be created directly under / (ofs layout: /volume/bucket/path)");
  }
}
