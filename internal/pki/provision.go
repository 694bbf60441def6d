package pki

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Provisioner issues the certificates of a cluster that runs on one
// machine (`basalt dev`, in-process test clusters): the CA lives in
// Dir/ca and each identity's TLS directory in Dir/<role>-<id>. It is
// idempotent: existing files are loaded, so a restarted cluster keeps
// its CA and every node its certificate.
type Provisioner struct {
	Dir string
	ca  *CA
}

// NewProvisioner loads Dir/ca or creates it.
func NewProvisioner(dir string) (*Provisioner, error) {
	caDir := filepath.Join(dir, "ca")
	ca, err := LoadCA(caDir)
	if errors.Is(err, os.ErrNotExist) {
		if ca, err = NewCA("basalt cluster CA"); err == nil {
			err = ca.Save(caDir)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("pki: cluster CA in %s: %w", caDir, err)
	}
	return &Provisioner{Dir: dir, ca: ca}, nil
}

// CA is the provisioner's CA.
func (p *Provisioner) CA() *CA { return p.ca }

// DirOf is id's TLS directory.
func (p *Provisioner) DirOf(id Identity) string {
	return filepath.Join(p.Dir, string(id.Role)+"-"+id.ID)
}

// Credentials loads id's credentials, issuing and saving them first if
// they do not exist.
func (p *Provisioner) Credentials(id Identity) (*Credentials, error) {
	dir := p.DirOf(id)
	c, err := Load(dir)
	if err == nil {
		if c.Identity != id {
			return nil, fmt.Errorf("pki: %s holds a certificate of %s, want %s", dir, c.Identity, id)
		}
		return c, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if c, err = p.ca.Issue(id, CAValidity); err != nil {
		return nil, err
	}
	if err := c.Save(dir); err != nil {
		return nil, err
	}
	return c, nil
}
