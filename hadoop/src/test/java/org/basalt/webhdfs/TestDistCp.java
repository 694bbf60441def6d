package org.basalt.webhdfs;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNotEquals;

import java.io.ByteArrayOutputStream;
import java.io.InputStream;
import java.io.OutputStream;
import java.util.Random;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.tools.DistCp;
import org.apache.hadoop.util.ToolRunner;
import org.junit.Test;

/**
 * One small DistCp job (MapReduce's local runner) from webhdfs:// to
 * webhdfs://, then `distcp -update` after a destination file changed.
 *
 * DistCp cannot compare checksums with webhdfs:// as its source: it asks
 * FileSystem.getFileChecksum(path, length), which WebHdfsFileSystem (3.4.1)
 * does not override (the default returns null, "no checksum"), so -update
 * decides on length (and modification time) only. The files' checksums are
 * still compared here directly: equal bytes, equal checksums.
 */
public class TestDistCp {
  private static byte[] data(int n, long seed) {
    byte[] b = new byte[n];
    new Random(seed).nextBytes(b);
    return b;
  }

  private static void write(FileSystem fs, Path p, byte[] b) throws Exception {
    try (OutputStream o = fs.create(p, true)) {
      o.write(b);
    }
  }

  private static byte[] read(FileSystem fs, Path p) throws Exception {
    ByteArrayOutputStream out = new ByteArrayOutputStream();
    try (InputStream in = fs.open(p)) {
      in.transferTo(out);
    }
    return out.toByteArray();
  }

  @Test
  public void testDistCpUpdateComparesChecksums() throws Exception {
    Configuration conf = new Configuration();
    String base = BasaltContract.uri().toString().replaceAll("/$", "") + "/distcp/job";
    Path root = new Path(base);
    FileSystem fs = root.getFileSystem(conf);
    fs.delete(root, true);
    Path src = new Path(base + "/src"), dst = new Path(base + "/dst");
    byte[][] files = {data(1000, 1), data(3 << 20, 2), data(0, 3)};
    for (int i = 0; i < files.length; i++) {
      write(fs, new Path(src, "d/f" + i), files[i]);
    }
    assertEquals(0, ToolRunner.run(conf, new DistCp(conf, null), new String[] {src.toString(), dst.toString()}));
    for (int i = 0; i < files.length; i++) {
      assertArrayEquals("f" + i, files[i], read(fs, new Path(dst, "d/f" + i)));
      assertEquals(fs.getFileChecksum(new Path(src, "d/f" + i)), fs.getFileChecksum(new Path(dst, "d/f" + i)));
    }
    // Another length: -update copies it again; the others are skipped.
    Path changed = new Path(dst, "d/f1");
    write(fs, changed, data(5000, 99));
    assertNotEquals(fs.getFileChecksum(new Path(src, "d/f1")), fs.getFileChecksum(changed));
    assertEquals(0, ToolRunner.run(conf, new DistCp(conf, null),
        new String[] {"-update", new Path(src, "d").toString(), new Path(dst, "d").toString()}));
    assertArrayEquals("f1 after distcp -update", files[1], read(fs, changed));
    assertEquals(fs.getFileChecksum(new Path(src, "d/f1")), fs.getFileChecksum(changed));
    fs.delete(root, true);
  }
}
