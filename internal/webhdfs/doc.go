// Package webhdfs is Basalt's WebHDFS gateway: a stateless HTTP server that
// speaks the WebHDFS REST protocol (as Hadoop 3.4's WebHdfsFileSystem client
// and HttpFS define it) over the Basalt client, so Hadoop tools reach fs
// buckets as webhdfs://host:port/ with no Basalt code on their side. Like
// the S3 gateway, any number of gateways can serve one cluster.
//
// The namespace is rooted like Ozone's ofs: "/" lists volumes, "/vol" its
// buckets, and "/vol/bucket/a/b" is path "a/b" of bucket "bucket", which
// must have the FS layout (directories keyed by their parent, so MKDIRS,
// RENAME and DELETE of a directory are one metadata operation whatever it
// holds). MKDIRS and CREATE create a missing volume and bucket (FS
// layout) on the way, as HDFS creates missing parents.
//
// Data moves in a bounded number of transfers at a time (Config.MaxTransfers),
// each with bounded buffers: CREATE streams the request body into PutKey
// (the client's bounded write buffer, V2 streaming for large files) and
// OPEN streams the key from the datanodes to the socket (answering 200
// itself rather than redirecting, as HttpFS does). CREATE uses the
// protocol's two steps: the first answers 307 with a Location on this same
// gateway carrying data=true, the second carries the data.
//
// File attributes HDFS has and Basalt's namespace does not (owner, group,
// permission, access time, and a modification time that SETTIMES can set)
// are kept in the file's key attributes (ObjectMeta.user, "hdfs-*" names)
// and changed with a CopyKey of the file onto itself, which shares the
// blocks and checks the version. Directories, volumes and buckets have no
// such storage yet: they report their volume's owner and mode 755, and
// SETPERMISSION/SETOWNER/SETTIMES on them answer UnsupportedOperationException
// rather than pretend. Nothing is enforced: permissions are recorded for the
// access checks of the security issue.
//
// Errors are RemoteException JSON with the Java class names Hadoop's client
// turns back into exceptions (FileNotFoundException,
// FileAlreadyExistsException, ParentNotDirectoryException,
// PathIsNotEmptyDirectoryException, ...), with the HTTP statuses the
// NameNode uses.
package webhdfs
