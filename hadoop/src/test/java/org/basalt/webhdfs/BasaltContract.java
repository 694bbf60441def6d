package org.basalt.webhdfs;

import java.io.IOException;
import java.net.URI;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.contract.AbstractFSContract;

/**
 * Hadoop's FileSystem contract for Basalt through its WebHDFS gateway. The
 * gateway's URI comes from the system property basalt.webhdfs.uri (set by
 * scripts/test-hadoop.sh); the options are in contract/basalt-webhdfs.xml.
 * Tests run under /contract/tests/test: volume "contract", FS bucket
 * "tests" (files cannot live directly under a volume, as in Ozone's ofs).
 */
public class BasaltContract extends AbstractFSContract {
  public static final String CONTRACT_XML = "contract/basalt-webhdfs.xml";
  public static final String TEST_PATH = "/contract/tests/test";

  private FileSystem fs;

  public BasaltContract(Configuration conf) {
    super(conf);
    addConfResource(CONTRACT_XML);
  }

  static URI uri() {
    return URI.create(System.getProperty("basalt.webhdfs.uri", "webhdfs://127.0.0.1:9870"));
  }

  @Override
  public void init() throws IOException {
    super.init();
    fs = FileSystem.get(uri(), getConf());
  }

  @Override
  public FileSystem getTestFileSystem() {
    return fs;
  }

  @Override
  public String getScheme() {
    return "webhdfs";
  }

  @Override
  public Path getTestPath() {
    return new Path(TEST_PATH);
  }
}
