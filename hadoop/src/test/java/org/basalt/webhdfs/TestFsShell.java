package org.basalt.webhdfs;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.security.MessageDigest;
import java.util.Random;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.FsShell;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.util.ToolRunner;
import org.junit.AfterClass;
import org.junit.BeforeClass;
import org.junit.FixMethodOrder;
import org.junit.Test;
import org.junit.runners.MethodSorters;

/**
 * `hadoop fs` commands through Hadoop's own FsShell against Basalt's
 * WebHDFS gateway, in one JVM (ToolRunner, as bin/hadoop fs runs it).
 * The big file's size comes from -Dbasalt.bigfile.mib (default 300).
 */
@FixMethodOrder(MethodSorters.NAME_ASCENDING)
public class TestFsShell {
  private static final String ROOT = "/shell/fsshell";
  private static String base;
  private static File tmp;
  private static Configuration conf;

  @BeforeClass
  public static void setUp() throws Exception {
    base = BasaltContract.uri().toString().replaceAll("/$", "") + ROOT;
    tmp = Files.createTempDirectory("fsshell").toFile();
    conf = new Configuration();
    run("-rm", "-r", "-f", base);
  }

  @AfterClass
  public static void tearDown() throws Exception {
    run("-rm", "-r", "-f", base);
    for (File f : tmp.listFiles()) {
      f.delete();
    }
    tmp.delete();
  }

  /** Runs one FsShell command; returns its exit code and keeps its stdout. */
  private static String out;

  private static int run(String... args) throws Exception {
    ByteArrayOutputStream buf = new ByteArrayOutputStream();
    PrintStream old = System.out;
    System.setOut(new PrintStream(buf, true, "UTF-8"));
    int rc;
    try {
      rc = ToolRunner.run(new FsShell(conf), args);
    } finally {
      System.setOut(old);
    }
    out = buf.toString("UTF-8");
    System.out.println("$ hadoop fs " + String.join(" ", args) + "  -> " + rc);
    System.out.print(out);
    return rc;
  }

  private static void ok(String... args) throws Exception {
    assertEquals("hadoop fs " + String.join(" ", args), 0, run(args));
  }

  private static File write(String name, long size, long seed) throws IOException {
    File f = new File(tmp, name);
    Random r = new Random(seed);
    byte[] b = new byte[1 << 20];
    try (OutputStream o = new FileOutputStream(f)) {
      for (long n = 0; n < size; n += b.length) {
        r.nextBytes(b);
        o.write(b, 0, (int) Math.min(b.length, size - n));
      }
    }
    return f;
  }

  private static byte[] sha256(File f) throws Exception {
    MessageDigest d = MessageDigest.getInstance("SHA-256");
    byte[] b = new byte[1 << 20];
    try (InputStream in = Files.newInputStream(f.toPath())) {
      for (int n; (n = in.read(b)) > 0; ) {
        d.update(b, 0, n);
      }
    }
    return d.digest();
  }

  @Test
  public void test1MkdirPutLs() throws Exception {
    ok("-mkdir", "-p", base + "/dir/sub");
    File small = write("small.txt", 1234, 1);
    ok("-put", small.getPath(), base + "/dir/small.txt");
    ok("-ls", "-R", base);
    assertTrue(out, out.contains(base + "/dir/sub"));
    assertTrue(out, out.contains(base + "/dir/small.txt"));
    assertTrue(out, out.contains(" 1234 "));
    ok("-cat", base + "/dir/small.txt");
    assertEquals(new String(Files.readAllBytes(small.toPath()), StandardCharsets.UTF_8), out);
    // -put onto an existing file fails without -f
    assertEquals(1, run("-put", small.getPath(), base + "/dir/small.txt"));
    ok("-put", "-f", small.getPath(), base + "/dir/small.txt");
  }

  @Test
  public void test2BigPutGetSha256() throws Exception {
    long mib = Long.getLong("basalt.bigfile.mib", 300);
    File big = write("big.bin", mib << 20, 2);
    long t0 = System.nanoTime();
    ok("-put", big.getPath(), base + "/dir/big.bin");
    long t1 = System.nanoTime();
    File got = new File(tmp, "big.got");
    ok("-get", base + "/dir/big.bin", got.getPath());
    long t2 = System.nanoTime();
    System.out.printf("put %d MiB: %.1f s, get: %.1f s%n", mib, (t1 - t0) / 1e9, (t2 - t1) / 1e9);
    assertArrayEquals("sha256 of the file read back", sha256(big), sha256(got));
    ok("-stat", "%b", base + "/dir/big.bin");
    assertEquals(String.valueOf(mib << 20), out.trim());
    got.delete();
    big.delete();
  }

  @Test
  public void test3MvDuChecksumTest() throws Exception {
    ok("-mv", base + "/dir", base + "/moved");
    assertEquals(1, run("-test", "-e", base + "/dir"));
    ok("-test", "-d", base + "/moved/sub");
    ok("-test", "-f", base + "/moved/small.txt");
    assertEquals(1, run("-test", "-d", base + "/moved/small.txt"));
    ok("-du", "-s", base + "/moved");
    assertTrue(out, out.trim().startsWith(String.valueOf(1234 + (Long.getLong("basalt.bigfile.mib", 300) << 20))));
    ok("-checksum", base + "/moved/small.txt");
    assertTrue(out, out.contains("MD5-of-0MD5-of-65536CRC32C"));
    ok("-cp", base + "/moved/small.txt", base + "/moved/copy.txt");
    String a = checksum(base + "/moved/small.txt");
    assertEquals(a, checksum(base + "/moved/copy.txt"));
  }

  private static String checksum(String p) throws Exception {
    ok("-checksum", p);
    return out.trim().split("\\s+", 2)[1];
  }

  @Test
  public void test4TouchzChmodSetrep() throws Exception {
    ok("-touchz", base + "/moved/empty");
    ok("-test", "-z", base + "/moved/empty");
    ok("-chmod", "600", base + "/moved/empty");
    ok("-ls", base + "/moved/empty");
    assertTrue(out, out.startsWith("-rw-------"));
    ok("-chown", "alice:staff", base + "/moved/empty");
    ok("-ls", base + "/moved/empty");
    assertTrue(out, out.contains("alice staff"));
    // Same replication: fine; another: Basalt cannot re-replicate a file.
    ok("-setrep", "3", base + "/moved/empty");
    assertTrue("setrep 1 must fail", run("-setrep", "1", base + "/moved/empty") != 0);
    // Directories keep owners and permissions too (-chmod -R and -chown -R
    // walk the tree), and -ls -d shows them.
    ok("-chmod", "-R", "750", base + "/moved/sub");
    ok("-chown", "-R", "bob:eng", base + "/moved/sub");
    ok("-ls", "-d", base + "/moved/sub");
    assertTrue(out, out.startsWith("drwxr-x---"));
    assertTrue(out, out.contains("bob eng"));
    // -mkdir records the caller as the owner (user.name of the JVM's user).
    ok("-mkdir", base + "/moved/mine");
    ok("-ls", "-d", base + "/moved/mine");
    assertTrue(out, out.startsWith("drwxr-xr-x"));
    assertTrue(out, out.contains(" " + System.getProperty("user.name") + " "));
  }

  @Test
  public void test5RmR() throws Exception {
    ok("-rm", "-r", base + "/moved");
    assertEquals(1, run("-test", "-e", base + "/moved"));
    ok("-ls", base);
    assertEquals("", out.trim());
    FileSystem fs = new Path(base).getFileSystem(conf);
    assertFalse(fs.exists(new Path(base + "/moved/small.txt")));
  }
}
