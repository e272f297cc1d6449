package main

import (
	"encoding/json"
	"path/filepath"
	"testing"
)

func TestPodmanRefIsContainersImageName(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1:5000/lazy/app:v1": "127.0.0.1:5000/lazy/app:v1",
		"127.0.0.1:5000/lazy/app":    "127.0.0.1:5000/lazy/app:latest",
		"busybox":                    "docker.io/library/busybox:latest",
		"reg.example/a/b@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef": "reg.example/a/b@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
	} {
		got, err := podmanRef(in)
		if err != nil || got != want {
			t.Errorf("podmanRef(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := podmanRef("not a reference!"); err == nil {
		t.Error("podmanRef accepted an invalid reference")
	}
}

func TestRefDirIsBase64OfTheReference(t *testing.T) {
	// containers/storage: path.Join(store, base64.StdEncoding(ref), digest)
	got := refDir("/s", "127.0.0.1:5123/lazy/small:v1")
	if want := filepath.Join("/s", "MTI3LjAuMC4xOjUxMjMvbGF6eS9zbWFsbDp2MQ=="); got != want {
		t.Errorf("refDir = %q, want %q", got, want)
	}
}

func TestLayerInfoJSON(t *testing.T) {
	data, err := json.Marshal(alsLayerInfo{
		CompressedDigest: "sha256:aa", CompressedSize: 258, UncompressedDigest: "sha256:bb",
		CompressionType: compressionOf("application/vnd.oci.image.layer.v1.tar+gzip"),
	})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"compressed-diff-digest":"sha256:aa","compressed-size":258,"diff-digest":"sha256:bb","compression":2}`
	if string(data) != want {
		t.Errorf("info = %s, want %s", data, want)
	}
	for mt, c := range map[string]int{
		"application/vnd.docker.image.rootfs.diff.tar.gzip": 2,
		"application/vnd.oci.image.layer.v1.tar+zstd":       4,
		"application/vnd.oci.image.layer.v1.tar":            0,
	} {
		if got := compressionOf(mt); got != c {
			t.Errorf("compressionOf(%s) = %d, want %d", mt, got, c)
		}
	}
}
