package org.basalt.webhdfs;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.contract.AbstractContractSeekTest;
import org.apache.hadoop.fs.contract.AbstractFSContract;
import static org.apache.hadoop.fs.contract.ContractTestUtils.skip;

import org.junit.Test;

public class TestBasaltContractSeek extends AbstractContractSeekTest {
  @Override
  protected AbstractFSContract createContract(Configuration conf) {
    return new BasaltContract(conf);
  }

  @Override
  @Test
  public void testNegativeSeek() throws Throwable {
    // WebHdfsFileSystem's input stream accepts seek(-1) and then builds
    // an OffsetParam(-1) on read, which throws IllegalArgumentException
    // (not an IOException) before any request reaches the server.
    skip("Hadoop's WebHDFS client fails a negative seek client-side with IllegalArgumentException");
  }
}
