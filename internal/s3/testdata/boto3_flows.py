"""Core S3 flows with boto3 against a Basalt S3 gateway.

Run by TestPythonClients (python_test.go) with ENDPOINT, AWS_ACCESS_KEY_ID
and AWS_SECRET_ACCESS_KEY set. Exits non-zero on the first failure.
"""
import hashlib
import os
import sys

import boto3
import botocore
from botocore.config import Config

endpoint = os.environ["ENDPOINT"]
s3 = boto3.client(
    "s3",
    endpoint_url=endpoint,
    region_name="us-east-1",
    config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
)


def expect_error(code, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except botocore.exceptions.ClientError as e:
        got = e.response["Error"]["Code"]
        assert got == code, f"want {code}, got {got}"
        return
    raise AssertionError(f"want {code}, got success")


bucket = "boto3-flows"
s3.create_bucket(Bucket=bucket)
assert bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]
expect_error("BucketAlreadyOwnedByYou", s3.create_bucket, Bucket=bucket)

# Put and get, with metadata and content type; ETag is the body's MD5.
body = os.urandom(3 * 1024 * 1024 + 17)
r = s3.put_object(Bucket=bucket, Key="dir/a.bin", Body=body, ContentType="application/x-test",
                  Metadata={"color": "blue"})
assert r["ETag"].strip('"') == hashlib.md5(body).hexdigest(), r["ETag"]
g = s3.get_object(Bucket=bucket, Key="dir/a.bin")
assert g["Body"].read() == body
assert g["ContentType"] == "application/x-test"
assert g["Metadata"] == {"color": "blue"}, g["Metadata"]
h = s3.head_object(Bucket=bucket, Key="dir/a.bin")
assert h["ContentLength"] == len(body)
rg = s3.get_object(Bucket=bucket, Key="dir/a.bin", Range="bytes=10-19")["Body"].read()
assert rg == body[10:20]
expect_error("NoSuchKey", s3.get_object, Bucket=bucket, Key="missing")
expect_error("NoSuchBucket", s3.get_object, Bucket="no-such-bucket-x", Key="k")

# Listing with a delimiter.
for k in ["dir/b.txt", "top.txt"]:
    s3.put_object(Bucket=bucket, Key=k, Body=b"x")
ls = s3.list_objects_v2(Bucket=bucket, Delimiter="/")
assert [c["Prefix"] for c in ls.get("CommonPrefixes", [])] == ["dir/"], ls
assert [o["Key"] for o in ls.get("Contents", [])] == ["top.txt"], ls

# Multipart upload (upload_file switches to multipart above the threshold).
from boto3.s3.transfer import TransferConfig
big = os.urandom(12 * 1024 * 1024)
path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "boto3-big.bin")
with open(path, "wb") as f:
    f.write(big)
s3.upload_file(path, bucket, "big.bin",
               Config=TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024))
assert s3.get_object(Bucket=bucket, Key="big.bin")["Body"].read() == big
assert s3.head_object(Bucket=bucket, Key="big.bin")["ETag"].strip('"').endswith("-3")

# Conditional writes: create-only and compare-and-swap.
s3.put_object(Bucket=bucket, Key="cond", Body=b"one", IfNoneMatch="*")
expect_error("PreconditionFailed", s3.put_object, Bucket=bucket, Key="cond", Body=b"two", IfNoneMatch="*")
etag = s3.head_object(Bucket=bucket, Key="cond")["ETag"]
s3.put_object(Bucket=bucket, Key="cond", Body=b"three", IfMatch=etag)
expect_error("PreconditionFailed", s3.put_object, Bucket=bucket, Key="cond", Body=b"four", IfMatch=etag)
assert s3.get_object(Bucket=bucket, Key="cond")["Body"].read() == b"three"
s3.delete_object(Bucket=bucket, Key="cond")
# Sub-resources the gateway lacks are refused, not served as a listing.
expect_error("NotImplemented", s3.get_bucket_website, Bucket=bucket)
expect_error("NotImplemented", s3.get_object_retention, Bucket=bucket, Key="dir/a.bin")

# Copy and delete.
s3.copy_object(Bucket=bucket, Key="copy.bin", CopySource={"Bucket": bucket, "Key": "dir/a.bin"})
assert s3.get_object(Bucket=bucket, Key="copy.bin")["Body"].read() == body
d = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in
                                                          ["dir/a.bin", "dir/b.txt", "top.txt", "big.bin", "copy.bin"]]})
assert len(d.get("Deleted", [])) == 5, d
expect_error("404", s3.head_object, Bucket=bucket, Key="top.txt")  # HEAD has no body: botocore reports the status
s3.delete_bucket(Bucket=bucket)

# Wrong credentials get the proper error, never data.
bad = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                   aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"], aws_secret_access_key="wrong-secret",
                   config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
expect_error("SignatureDoesNotMatch", bad.list_buckets)

# Access control: canned ACLs, ACL documents, a bucket policy for
# anonymous readers, its status, Block Public Access.
import json
import urllib.error
import urllib.request


def anon_get(path):
    try:
        with urllib.request.urlopen(endpoint + path, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


acl_bucket = "boto3-acl"
s3.create_bucket(Bucket=acl_bucket)
s3.put_object(Bucket=acl_bucket, Key="pub.txt", Body=b"public", ACL="public-read")
s3.put_object(Bucket=acl_bucket, Key="priv.txt", Body=b"private")
grants = s3.get_object_acl(Bucket=acl_bucket, Key="pub.txt")["Grants"]
assert any(g["Grantee"].get("URI", "").endswith("/AllUsers") and g["Permission"] == "READ" for g in grants), grants
assert anon_get(f"/{acl_bucket}/pub.txt") == (200, b"public")
assert anon_get(f"/{acl_bucket}/priv.txt")[0] == 403
acl = s3.get_bucket_acl(Bucket=acl_bucket)
assert [g["Permission"] for g in acl["Grants"]] == ["FULL_CONTROL"], acl["Grants"]
s3.put_bucket_acl(Bucket=acl_bucket, AccessControlPolicy={"Owner": acl["Owner"], "Grants": acl["Grants"] + [
    {"Grantee": {"Type": "Group", "URI": "http://acs.amazonaws.com/groups/global/AllUsers"}, "Permission": "READ"}]})
assert anon_get(f"/{acl_bucket}?list-type=2")[0] == 200
s3.put_bucket_acl(Bucket=acl_bucket, ACL="private")
assert anon_get(f"/{acl_bucket}?list-type=2")[0] == 403

expect_error("NoSuchBucketPolicy", s3.get_bucket_policy, Bucket=acl_bucket)
expect_error("MalformedPolicy", s3.put_bucket_policy, Bucket=acl_bucket, Policy='{"Statement": [')
assert s3.get_bucket_policy_status(Bucket=acl_bucket)["PolicyStatus"]["IsPublic"] is False
policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                                                  "Resource": f"arn:aws:s3:::{acl_bucket}/priv.txt"}]}
s3.put_bucket_policy(Bucket=acl_bucket, Policy=json.dumps(policy))
assert json.loads(s3.get_bucket_policy(Bucket=acl_bucket)["Policy"])["Statement"][0]["Action"] == "s3:GetObject"
assert s3.get_bucket_policy_status(Bucket=acl_bucket)["PolicyStatus"]["IsPublic"] is True
assert anon_get(f"/{acl_bucket}/priv.txt") == (200, b"private")
expect_error("NoSuchPublicAccessBlockConfiguration", s3.get_public_access_block, Bucket=acl_bucket)
s3.put_public_access_block(Bucket=acl_bucket, PublicAccessBlockConfiguration={
    "BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True, "RestrictPublicBuckets": True})
assert s3.get_public_access_block(Bucket=acl_bucket)["PublicAccessBlockConfiguration"]["RestrictPublicBuckets"] is True
assert anon_get(f"/{acl_bucket}/priv.txt")[0] == 403
assert anon_get(f"/{acl_bucket}/pub.txt")[0] == 403  # IgnorePublicAcls
s3.delete_public_access_block(Bucket=acl_bucket)
s3.delete_bucket_policy(Bucket=acl_bucket)
assert anon_get(f"/{acl_bucket}/priv.txt")[0] == 403
s3.delete_objects(Bucket=acl_bucket, Delete={"Objects": [{"Key": "pub.txt"}, {"Key": "priv.txt"}]})
s3.delete_bucket(Bucket=acl_bucket)
print("boto3 flows: ok")
