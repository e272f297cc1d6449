package main

// The registry resolver of `pull` and `podman-store`, and registry credentials from
// docker's config.json ($DOCKER_CONFIG/config.json, else
// ~/.docker/config.json): `auths[host].auth`, base64 of USER:PASS, as docker login and
// skopeo write it. Credential helpers (credsStore) are not used.

import (
	"encoding/base64"

	"encoding/json"
	"errors"
	"fmt"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"os"
	"path/filepath"
	"strings"
)

func dockerConfigPath() string {
	if d := os.Getenv("DOCKER_CONFIG"); d != "" {
		return filepath.Join(d, "config.json")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return ""
	}
	return filepath.Join(home, ".docker", "config.json")
}

// dockerCredentials: (user, password) for host from the config file at path; empty when
// the file or the entry is absent.
func dockerCredentials(path, host string) (string, string, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) || path == "" {
		return "", "", nil
	}
	if err != nil {
		return "", "", err
	}
	var cfg struct {
		Auths map[string]struct {
			Auth string `json:"auth"`
		} `json:"auths"`
	}
	if err := json.Unmarshal(data, &cfg); err != nil {
		return "", "", fmt.Errorf("%s: %w", path, err)
	}
	for key, entry := range cfg.Auths {
		// docker writes "https://index.docker.io/v1/" style keys as well as bare hosts
		k := strings.TrimSuffix(strings.TrimPrefix(strings.TrimPrefix(key, "https://"), "http://"), "/")
		if k != host || entry.Auth == "" {
			continue
		}
		raw, err := base64.StdEncoding.DecodeString(entry.Auth)
		if err != nil {
			return "", "", fmt.Errorf("%s: auths[%s].auth: %w", path, key, err)
		}
		user, pass, ok := strings.Cut(string(raw), ":")
		if !ok {
			return "", "", fmt.Errorf("%s: auths[%s].auth: not USER:PASS", path, key)
		}
		return user, pass, nil
	}
	return "", "", nil
}

// newResolver: plain HTTP for localhost (for every host with plainHTTP); credentials from
// auth (USER:PASS), else docker's config.json.
func newResolver(plainHTTP bool, auth string) (remotes.Resolver, error) {
	hostOpts := []docker.RegistryOpt{docker.WithPlainHTTP(docker.MatchLocalhost)}
	if plainHTTP {
		hostOpts = []docker.RegistryOpt{docker.WithPlainHTTP(func(string) (bool, error) { return true, nil })}
	}
	var creds func(host string) (string, string, error)
	if auth != "" {
		user, pass, ok := strings.Cut(auth, ":")
		if !ok {
			return nil, fmt.Errorf("--auth: credentials must be USER:PASS")
		}
		creds = func(string) (string, string, error) { return user, pass, nil }
	} else {
		path := dockerConfigPath()
		creds = func(host string) (string, string, error) { return dockerCredentials(path, host) }
	}
	hostOpts = append(hostOpts, docker.WithAuthorizer(docker.NewDockerAuthorizer(docker.WithAuthCreds(creds))))
	return docker.NewResolver(docker.ResolverOptions{Hosts: docker.ConfigureDefaultRegistries(hostOpts...)}), nil
}
