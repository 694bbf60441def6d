package metapb

// Reasons in the google.rpc.ErrorInfo detail of namespace errors (domain
// ReasonDomain), so that clients and gateways tell what failed without
// parsing messages: a NotFound says which resource is missing. Hand
// written: not generated from proto/meta.
const (
	ReasonDomain = "namespace.basalt"

	ReasonNoSuchVolume = "NO_SUCH_VOLUME"
	ReasonNoSuchBucket = "NO_SUCH_BUCKET"
	ReasonNoSuchKey    = "NO_SUCH_KEY"
	ReasonNoSuchUpload = "NO_SUCH_UPLOAD"

	ReasonInvalidPart      = "INVALID_PART"
	ReasonInvalidPartOrder = "INVALID_PART_ORDER"
	ReasonEntityTooSmall   = "ENTITY_TOO_SMALL"
	ReasonVersionChanged   = "VERSION_CHANGED"
	ReasonNotShareable     = "NOT_SHAREABLE" // CopyKey cannot share the blocks; copy the bytes
)
