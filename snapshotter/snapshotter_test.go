package main

import (
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func TestBundleOf(t *testing.T) {
	loc := "oci://reg.example:5000/lazy/app@" + digest
	labels := map[string]string{labelBundle: digest, labelLocation: loc, labelImageID: "sha256:ab"}
	b, ours, err := bundleOf(labels)
	if err != nil || !ours || b.location != loc || b.imageID != "sha256:ab" {
		t.Fatalf("bundleOf = %+v %v %v", b, ours, err)
	}
	// the CRI's image ref (a mirror) wins over the location the image was pushed to
	labels[labelImageRef] = "mirror.example/lazy/app:v1"
	if b, _, _ := bundleOf(labels); b.location != "oci://mirror.example/lazy/app@"+digest {
		t.Fatalf("with image ref: %s", b.location)
	}
	// and the image's own manifest, when containerd names it, over its bundle
	image := "sha256:" + strings.Repeat("ab", 32)
	labels[labelManifest] = image
	if b, _, _ := bundleOf(labels); b.location != "oci://mirror.example/lazy/app@"+image || b.imageID != "sha256:ab" {
		t.Fatalf("with manifest digest: %+v", b)
	}
	labels[labelManifest] = "sha256:short"
	if b, _, _ := bundleOf(labels); b.location != "oci://mirror.example/lazy/app@"+digest {
		t.Fatalf("with a bad manifest digest: %s", b.location)
	}
	if _, ours, _ := bundleOf(map[string]string{"other": "x"}); ours {
		t.Fatal("a layer without the bundle label is ours")
	}
	for _, bad := range []map[string]string{
		{labelBundle: "sha256:short", labelLocation: loc},
		{labelBundle: digest},                                            // no location at all
		{labelBundle: digest, labelLocation: "https://x/y@" + digest},    // not oci://
		{labelBundle: digest, labelLocation: "oci://x/y@sha256:" + "00"}, // another digest
	} {
		if _, ours, err := bundleOf(bad); !ours || err == nil {
			t.Errorf("bundleOf(%v): ours=%v err=%v, want an error", bad, ours, err)
		}
	}
}

func TestRepository(t *testing.T) {
	for in, want := range map[string]string{
		"reg:5000/a/b:v1":                   "reg:5000/a/b",
		"reg:5000/a/b":                      "reg:5000/a/b",
		"reg/a/b@" + digest:                 "reg/a/b",
		"reg:5000/a/b:v1@" + digest:         "reg:5000/a/b",
		"docker.io/library/debian:bookworm": "docker.io/library/debian",
	} {
		if got := repository(in); got != want {
			t.Errorf("repository(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestUblkdArgs(t *testing.T) {
	u := ublkdArgv{bin: "ublkd", global: []string{"-v"}, mount: []string{"--frontend=fuse"}}
	if got := u.args("mount", "SRC", "DIR"); !reflect.DeepEqual(got, []string{"-v", "mount", "--frontend=fuse", "SRC", "DIR"}) {
		t.Errorf("mount args %v", got)
	}
	if got := u.args("umount", "DIR"); !reflect.DeepEqual(got, []string{"-v", "umount", "DIR"}) {
		t.Errorf("umount args %v", got)
	}
}

func TestDockerCredentials(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.json")
	// base64("user:pa:ss")
	data := `{"auths": {"https://reg.example:5000/": {"auth": "dXNlcjpwYTpzcw=="}, "other": {"auth": "!"}}}`
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	user, pass, err := dockerCredentials(path, "reg.example:5000")
	if err != nil || user != "user" || pass != "pa:ss" {
		t.Fatalf("got %q %q %v", user, pass, err)
	}
	if user, _, err := dockerCredentials(path, "nowhere"); err != nil || user != "" {
		t.Fatalf("absent host: %q %v", user, err)
	}
	if _, _, err := dockerCredentials(path, "other"); err == nil {
		t.Fatal("bad base64 accepted")
	}
	if user, _, err := dockerCredentials(filepath.Join(dir, "missing.json"), "x"); err != nil || user != "" {
		t.Fatalf("missing file: %q %v", user, err)
	}
}

func TestPolicyFlagsPassAbsolutePathsAndRefuseMissingFiles(t *testing.T) {
	dir := t.TempDir()
	policy := filepath.Join(dir, "policy.json")
	if err := os.WriteFile(policy, []byte(`{"default":[{"type":"reject"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	p := addPolicyFlags(fs)
	if err := fs.Parse([]string{"--policy", policy, "--registries-d", dir}); err != nil {
		t.Fatal(err)
	}
	got, err := p.mountArgs()
	if want := []string{"--policy=" + policy, "--registries-d=" + dir}; err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("mountArgs() = %v, %v; want %v", got, err, want)
	}
	fs = flag.NewFlagSet("x", flag.ContinueOnError)
	p = addPolicyFlags(fs)
	_ = fs.Parse([]string{"--policy", filepath.Join(dir, "missing.json")})
	if _, err := p.mountArgs(); err == nil || !strings.Contains(err.Error(), "--policy") {
		t.Fatalf("a missing policy file: %v", err)
	}
	fs = flag.NewFlagSet("x", flag.ContinueOnError)
	p = addPolicyFlags(fs)
	_ = fs.Parse(nil)
	if got, err := p.mountArgs(); err != nil || len(got) != 0 {
		t.Fatalf("no flags: %v, %v", got, err)
	}
}
